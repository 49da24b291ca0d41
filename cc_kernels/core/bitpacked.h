// The fully binary forward (binary_conv.cc): signs packed into 64-bit
// words, dot products by xor and popcount, on the plan's tier (portable,
// AVX2 in simd_avx2.h, AVX-512 VPOPCNTDQ in simd_avx512.h).
#ifndef TAPEHOOK_CORE_BITPACKED_H_
#define TAPEHOOK_CORE_BITPACKED_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "binary_conv.h"
#include "conv_util.h"
#include "geometry.h"
#include "plan.h"
#include "simd_avx2.h"
#include "simd_avx512.h"

namespace tapehook {

// ---------------------------------------------------------------------------
// Fully binary forward: x_hat and sign(W) as bits, dot products by xor and
// popcount. Bit 1 means -1. Each input pixel's in_c signs fill whole 64-bit
// words (the bits past in_c are 0 in x and W, so their xor adds nothing); a
// row of the bit im2col holds the words of all taps, in HWIO order.

// Output pixels per bit-im2col block.
constexpr int64_t kBitPixelBlock = 64;

inline int64_t WordsPerPixel(const ConvShape& s) { return (s.in_c + 63) / 64; }

// Inner loops of one BitpackedForward call: the plan's tier.
enum class BitIsa { kPortable, kAvx2, kAvx512 };

inline BitIsa BitIsaOf(Impl impl) {
  return impl == Impl::kAvx512 ? BitIsa::kAvx512
         : impl == Impl::kAvx2 ? BitIsa::kAvx2
                               : BitIsa::kPortable;
}

// thr ([c], or null): the signs of x - thr, the difference rounded to T.
template <typename T>
void PackSignsPortable(const T* x, int64_t c, uint64_t* out, const T* thr) {
  for (int64_t w = 0; w * 64 < c; ++w) {
    uint64_t bits = 0;
    const int64_t n = std::min<int64_t>(64, c - w * 64);
    for (int64_t b = 0; b < n; ++b) {
      const int64_t i = w * 64 + b;
      const T v = thr != nullptr ? static_cast<T>(x[i] - thr[i]) : x[i];
      bits |= static_cast<uint64_t>(!(v >= T(0))) << b;
    }
    out[w] = bits;
  }
}

// (The AVX-512 tier packs floats with simd::PackSigns512 and
// simd::PackWeightTap512, over whole runs; doubles take the portable loops.)
template <typename T>
void PackSigns(BitIsa isa, const T* x, int64_t c, uint64_t* out, const T* thr) {
#if TAPEHOOK_HAVE_AVX2_PATH
  if constexpr (std::is_same_v<T, float>) {
    if (isa == BitIsa::kAvx2) return simd::PackSigns(x, c, out, thr);
  }
#endif
  PackSignsPortable(x, c, out, thr);
}

template <typename T>
void PackWeightSigns(BitIsa isa, const T* w, int64_t n, int shift,
                     uint64_t* words, double* abs_sum) {
#if TAPEHOOK_HAVE_AVX2_PATH
  if constexpr (std::is_same_v<T, float>) {
    if (isa == BitIsa::kAvx2) {
      return simd::PackWeightSigns(w, n, shift, words, abs_sum);
    }
  }
#endif
  for (int64_t o = 0; o < n; ++o) {
    words[o] |= static_cast<uint64_t>(!(w[o] >= T(0))) << shift;
    if (abs_sum != nullptr) abs_sum[o] += std::abs(static_cast<double>(w[o]));
  }
}

// counts[i * ldc + j] = sum_k popcount(a[i * depth + k] ^ b[k * n + j]):
// the portable tier's loops (the AVX2 tier runs simd::XorPopcountNibbles).
inline void XorPopcountPortable(int64_t m, int64_t n, int64_t depth,
                                const uint64_t* a, const uint64_t* b,
                                int32_t* counts, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    std::fill(counts + i * ldc, counts + i * ldc + n, 0);
    for (int64_t k = 0; k < depth; ++k) {
      const uint64_t ak = a[i * depth + k];
      const uint64_t* bk = b + k * n;
      for (int64_t j = 0; j < n; ++j) {
        counts[i * ldc + j] += __builtin_popcountll(ak ^ bk[j]);
      }
    }
  }
}

// Columns of W are padded to whole register tiles of the AVX2 xor-popcount.
#if TAPEHOOK_HAVE_AVX2_PATH
constexpr int64_t kPopColTile = simd::kPopNR;
#else
constexpr int64_t kPopColTile = 1;
#endif

// The nibble form of a word (simd_avx2.h): its bytes' low nibbles, and
// their high nibbles, each in the low half of its byte.
inline uint64_t LowNibbles(uint64_t v) { return v & 0x0f0f0f0f0f0f0f0full; }
inline uint64_t HighNibbles(uint64_t v) { return LowNibbles(v >> 4); }

// In place: words[0, n) become their nibble form in words[0, 2 n), each
// word's low nibbles, then its high ones.
inline void SplitNibbles(uint64_t* words, int64_t n) {
  for (int64_t i = n - 1; i >= 0; --i) {  // backwards: 2 i >= i
    const uint64_t v = words[i];
    words[2 * i] = LowNibbles(v);
    words[2 * i + 1] = HighNibbles(v);
  }
}

// W's words [rows][n_pad] as the AVX2 tier's nibble panels,
// [n_pad / kPopColTile][rows][lo | hi][kPopColTile].
inline std::vector<uint64_t> NibblePanels(const std::vector<uint64_t>& words,
                                          int64_t rows, int64_t n_pad) {
  std::vector<uint64_t> panels(2 * rows * n_pad);
  for (int64_t j = 0; j < n_pad; ++j) {
    uint64_t* panel = &panels[(j / kPopColTile) * rows * 2 * kPopColTile];
    for (int64_t k = 0; k < rows; ++k) {
      const uint64_t v = words[k * n_pad + j];
      uint64_t* at = panel + k * 2 * kPopColTile + j % kPopColTile;
      at[0] = LowNibbles(v);
      at[kPopColTile] = HighNibbles(v);
    }
  }
  return panels;
}

#if TAPEHOOK_HAVE_AVX512_PATH
// Output pixels per block of the AVX-512 tier: whole register tiles.
constexpr int64_t kBitPixelBlock512 = 8 * simd::kConvMR;

// Where the blocks of the AVX-512 tier find the signs of x.
enum class BitInput {
  kPacked,  // xb: all of x, packed in a pass of its own before the blocks
  kBands,   // each unit packs the input rows of a band of output rows
  kPixels,  // Pointwise(s): each block packs the input pixels it reads
};

// True when each output pixel reads exactly one input pixel, never padding:
// a 1x1 filter, no leading padding, no output past the input.
inline bool Pointwise(const ConvShape& s) {
  return s.k_h == 1 && s.k_w == 1 && s.pad_top == 0 && s.pad_left == 0 &&
         (s.out_h - 1) * s.stride_h < s.in_h &&
         (s.out_w - 1) * s.stride_w < s.in_w;
}

// Packing inside the units keeps a unit's signs in cache and spreads the
// read of x over the threads with the popcounts, instead of a pass of its own
// (which, for a large x, runs at the speed of memory and ends in a barrier).
// A small x is packed up front: that pass is short, and blocks of pixels
// share out better than bands.
inline BitInput PickBitInput(const ConvShape& s) {
  if (Pointwise(s)) return BitInput::kPixels;
  constexpr int64_t kSmallInput = 1 << 18;  // values of x
  return s.batch * s.in_h * s.in_w * s.in_c < kSmallInput ? BitInput::kPacked
                                                          : BitInput::kBands;
}

// Pixels per block of the packed and pixel forms: whole register tiles,
// at most kBitPixelBlock512, and few enough that a small output (batch 1,
// a late stage: 7x7 = 49 pixels) still makes kMinBlocks blocks. Full-size
// blocks there left one thread 48 pixels and the other 1.
inline int64_t SharedPixelBlock(int64_t pixels) {
  constexpr int64_t kMinBlocks = 16;
  const int64_t even = (pixels + kMinBlocks - 1) / kMinBlocks;
  const int64_t block =
      (even + simd::kConvMR - 1) / simd::kConvMR * simd::kConvMR;
  return std::min<int64_t>(kBitPixelBlock512,
                           std::max<int64_t>(block, simd::kConvMR));
}

// Output rows per band: at least enough that the input rows two bands share
// add at most a quarter to the packing, else as few as give about kBandUnits
// units over the batch.
inline int64_t BandRows(const ConvShape& s) {
  constexpr int64_t kBandUnits = 64;
  const int64_t shared = std::max<int64_t>(
      0, (s.k_h - 1) * s.dil_h + 1 - s.stride_h);  // input rows per seam
  const int64_t min_rows = (4 * shared + s.stride_h - 1) / s.stride_h;
  const int64_t rows = (s.out_h * s.batch + kBandUnits - 1) / kBandUnits;
  return std::min(s.out_h, std::max({rows, min_rows, int64_t{1}}));
}

// The rest of BitpackedForward on the AVX-512 tier, given its packed signs
// of W (wb with n_pad columns), tap popcounts and alpha, and x as `input`
// says: packed (xb) or as floats (x). Interior pixels get no bit im2col: the
// tile reads their words in the packed input, one run per kernel row
// (dil_w == 1) or per tap. Border pixels get a zero-padded row and their own
// bias (see simd::BitConvBlock); outputs leave the registers done.
template <typename T>
void BitpackedBlocks512(const ConvShape& s, BitInput input, const T* x,
                        const uint64_t* xb, const uint64_t* wb, int64_t n_pad,
                        const int32_t* tap_count, const T* alpha, T* y,
                        const ParallelFor& parallel_for, const T* offset,
                        bool relu, const T* addend, const T* thr = nullptr) {
  const int64_t C = s.in_c, N = s.out_c;
  const int64_t cw = WordsPerPixel(s);
  const int64_t taps = s.k_h * s.k_w;
  const int64_t row_words = taps * cw;
  const int64_t pixels = OutPixels(s);
  const bool runs = s.dil_w == 1;
  const int64_t segs = runs ? s.k_h : taps;
  const int64_t seg_len = runs ? s.k_w * cw : cw;
  auto inside = [&](int64_t ih, int64_t iw) {
    return ih >= 0 && ih < s.in_h && iw >= 0 && iw < s.in_w;
  };

  // Bias rows by output position (which taps fall in the padding does not
  // depend on the image). Interior positions share one row: every tap valid,
  // all_match = taps * C. At a border position, a padding tap's zero words
  // count popcount(W tap) mismatches: bias = valid * C + 2 * those, so that
  // bias - 2 * count is the exact dot product.
  const std::vector<int32_t> interior_bias(N, static_cast<int32_t>(taps * C));
  std::vector<const int32_t*> pos_bias(s.out_h * s.out_w, interior_bias.data());
  std::vector<int64_t> border_pos;
  for (int64_t oh = 0; oh < s.out_h; ++oh) {
    const int64_t ih0 = oh * s.stride_h - s.pad_top;
    for (int64_t ow = 0; ow < s.out_w; ++ow) {
      const int64_t iw0 = ow * s.stride_w - s.pad_left;
      if (!inside(ih0, iw0) ||
          !inside(ih0 + (s.k_h - 1) * s.dil_h, iw0 + (s.k_w - 1) * s.dil_w)) {
        border_pos.push_back(oh * s.out_w + ow);
      }
    }
  }
  std::vector<int32_t> border_bias(border_pos.size() * N, 0);
  for (size_t i = 0; i < border_pos.size(); ++i) {
    const int64_t oh = border_pos[i] / s.out_w, ow = border_pos[i] % s.out_w;
    int32_t* bp = &border_bias[i * N];
    int64_t valid = taps;
    for (int64_t kh = 0, t = 0; kh < s.k_h; ++kh) {
      for (int64_t kw = 0; kw < s.k_w; ++kw, ++t) {
        if (inside(oh * s.stride_h - s.pad_top + kh * s.dil_h,
                   ow * s.stride_w - s.pad_left + kw * s.dil_w)) {
          continue;
        }
        --valid;
        for (int64_t o = 0; o < N; ++o) bp[o] += 2 * tap_count[t * N + o];
      }
    }
    for (int64_t o = 0; o < N; ++o) bp[o] += static_cast<int32_t>(valid * C);
    pos_bias[border_pos[i]] = bp;
  }

  // Scratch of one thread, and the block of output pixels [pix0, pix0 + np)
  // (np <= kBitPixelBlock512). image_rows(n) gives image n's packed rows
  // and the input row they start at; the block prefetches `lines` cache
  // lines from `next` (see simd::BitConvBlock).
  struct Scratch {
    std::vector<const uint64_t*> seg;
    std::vector<const int32_t*> bias;
    std::vector<uint64_t> rows;  // border pixels' rows, or kPixels' pixels
    std::vector<uint64_t> band;  // kBands: the unit's packed input rows
  };
  auto run_block = [&](Scratch& sc, int64_t pix0, int64_t np, auto image_rows,
                       const T* next, int64_t lines) {
    PixelPos q = Pos(s, pix0);
    if (input == BitInput::kPixels) {
      if constexpr (std::is_same_v<T, float>) {
        if (s.out_h == s.in_h && s.out_w == s.in_w) {
          // Stride 1: output and input pixels coincide, one run of np.
          simd::PackSigns512(x + pix0 * C, np, C, sc.rows.data(), thr);
        } else {
          for (int64_t p = 0; p < np; ++p) {
            const int64_t in_pix =
                (q.n * s.in_h + q.oh * s.stride_h) * s.in_w + q.ow * s.stride_w;
            simd::PackSigns512(x + in_pix * C, 1, C, &sc.rows[p * cw], thr);
            if (++q.ow == s.out_w) {
              q.ow = 0;
              if (++q.oh == s.out_h) q.oh = 0, ++q.n;
            }
          }
        }
      }
      for (int64_t p = 0; p < np; ++p) {
        sc.seg[p] = &sc.rows[p * cw];  // segs == 1, seg_len == cw
        sc.bias[p] = interior_bias.data();
      }
    } else {
      for (int64_t p = 0; p < np; ++p) {
        const std::pair<const uint64_t*, int64_t> image = image_rows(q.n);
        const uint64_t* xn = image.first;
        const int64_t ih_first = image.second;
        const uint64_t** sp = &sc.seg[p * segs];
        const int64_t ih0 = q.oh * s.stride_h - s.pad_top;
        const int64_t iw0 = q.ow * s.stride_w - s.pad_left;
        auto word = [&](int64_t ih, int64_t iw) {
          return xn + ((ih - ih_first) * s.in_w + iw) * cw;
        };
        sc.bias[p] = pos_bias[q.oh * s.out_w + q.ow];
        if (sc.bias[p] == interior_bias.data()) {
          for (int64_t kh = 0; kh < s.k_h; ++kh) {
            const uint64_t* src = word(ih0 + kh * s.dil_h, iw0);
            if (runs) {
              sp[kh] = src;
            } else {
              for (int64_t kw = 0; kw < s.k_w; ++kw) {
                sp[kh * s.k_w + kw] = src + kw * s.dil_w * cw;
              }
            }
          }
        } else {
          uint64_t* row = &sc.rows[p * row_words];
          for (int64_t kh = 0, t = 0; kh < s.k_h; ++kh) {
            const int64_t ih = ih0 + kh * s.dil_h;
            for (int64_t kw = 0; kw < s.k_w; ++kw, ++t) {
              const int64_t iw = iw0 + kw * s.dil_w;
              if (inside(ih, iw)) {
                std::copy_n(word(ih, iw), cw, row + t * cw);
              } else {
                std::fill_n(row + t * cw, cw, 0);
              }
            }
          }
          for (int64_t g = 0; g < segs; ++g) sp[g] = row + g * seg_len;
        }
        if (++q.ow == s.out_w) {
          q.ow = 0;
          if (++q.oh == s.out_h) q.oh = 0, ++q.n;
        }
      }
    }
    simd::BitConvBlock<T> block;
    block.seg = sc.seg.data();
    block.segs = segs;
    block.seg_len = seg_len;
    block.b = wb;
    block.ldb = n_pad;
    block.bias = sc.bias.data();
    block.alpha = alpha;
    block.y = y + pix0 * N;
    block.ldy = N;
    block.n = N;
    block.prefetch = reinterpret_cast<const char*>(next);
    block.prefetch_lines = lines;
    block.offset = offset;
    block.relu = relu;
    block.addend = addend != nullptr ? addend + pix0 * N : nullptr;
    simd::BitConv(block, np);
  };
  auto new_scratch = [&] {
    return Scratch{std::vector<const uint64_t*>(kBitPixelBlock512 * segs),
                   std::vector<const int32_t*>(kBitPixelBlock512),
                   std::vector<uint64_t>(kBitPixelBlock512 * row_words),
                   {}};
  };
  // About 1.5 cycles per 512 bit-MACs (64 bits by 8 channels), plus the rest.
  const int64_t pixel_cost = row_words * N / 4 + 1;
  // Whole cache lines in a run of values (a partial last one is left out).
  auto lines_of = [&](int64_t values) {
    return values * static_cast<int64_t>(sizeof(T)) / 64;
  };

  if (input != BitInput::kBands) {
    auto whole_input = [&](int64_t n) {
      return std::pair<const uint64_t*, int64_t>(xb + n * s.in_h * s.in_w * cw,
                                                 0);
    };
    const int64_t block = SharedPixelBlock(pixels);
    const int64_t blocks = (pixels + block - 1) / block;
    parallel_for(blocks, block * pixel_cost, [&](int64_t b0, int64_t b1) {
      Scratch sc = new_scratch();
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t pix0 = b * block;
        const int64_t np = std::min(block, pixels - pix0);
        // Stride-1 kPixels: the next block's floats follow.
        const bool ahead = input == BitInput::kPixels && s.out_h == s.in_h &&
                           s.out_w == s.in_w && b + 1 < b1;
        const int64_t next_np = std::min(block, pixels - pix0 - np);
        run_block(sc, pix0, np, whole_input, x + (pix0 + np) * C,
                  ahead ? lines_of(next_np * C) : 0);
      }
    });
    return;
  }

  // Bands: unit u is output rows [oh0, oh1) of image u / bands.
  const int64_t band_rows = BandRows(s);
  const int64_t bands = (s.out_h + band_rows - 1) / band_rows;
  const int64_t band_cost = band_rows * s.out_w * pixel_cost +
                            band_rows * s.stride_h * s.in_w * C / 4;
  // Input rows [ih_first, ih_end) that unit u reads, and its output rows.
  struct Band {
    int64_t n, oh0, oh1, ih_first, in_rows;
    int64_t values(const ConvShape& s) const {
      return in_rows * s.in_w * s.in_c;
    }
  };
  auto band_of = [&](int64_t u) {
    Band band;
    band.n = u / bands;
    band.oh0 = u % bands * band_rows;
    band.oh1 = std::min(s.out_h, band.oh0 + band_rows);
    band.ih_first = std::max<int64_t>(0, band.oh0 * s.stride_h - s.pad_top);
    const int64_t ih_end =
        std::min(s.in_h, (band.oh1 - 1) * s.stride_h - s.pad_top +
                             (s.k_h - 1) * s.dil_h + 1);
    band.in_rows = std::max<int64_t>(0, ih_end - band.ih_first);
    return band;
  };
  auto band_floats = [&](const Band& band) {
    return x + (band.n * s.in_h + band.ih_first) * s.in_w * C;
  };
  parallel_for(s.batch * bands, band_cost, [&](int64_t u0, int64_t u1) {
    Scratch sc = new_scratch();
    for (int64_t u = u0; u < u1; ++u) {
      const Band band = band_of(u);
      sc.band.resize(std::max<int64_t>(1, band.in_rows * s.in_w * cw));
      if constexpr (std::is_same_v<T, float>) {
        simd::PackSigns512(band_floats(band), band.in_rows * s.in_w, C,
                           sc.band.data(), thr);
      }
      auto band_input = [&](int64_t) {
        return std::pair<const uint64_t*, int64_t>(sc.band.data(),
                                                   band.ih_first);
      };
      // The blocks share out the prefetch of the next unit's floats.
      const Band next = band_of(std::min(u + 1, u1 - 1));
      const int64_t next_lines = u + 1 < u1 ? lines_of(next.values(s)) : 0;
      const int64_t begin = (band.n * s.out_h + band.oh0) * s.out_w;
      const int64_t end = (band.n * s.out_h + band.oh1) * s.out_w;
      const int64_t blocks =
          (end - begin + kBitPixelBlock512 - 1) / kBitPixelBlock512;
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t pix0 = begin + i * kBitPixelBlock512;
        const int64_t first_line = next_lines * i / blocks;
        run_block(sc, pix0, std::min(kBitPixelBlock512, end - pix0), band_input,
                  band_floats(next) + first_line * 64 / sizeof(T),
                  next_lines * (i + 1) / blocks - first_line);
      }
    }
  });
}
#endif  // TAPEHOOK_HAVE_AVX512_PATH

// How many times cheaper than the portable loops, per element, the packing
// loops of a tier run: saying so lets parallel_for run small passes inline
// instead of waking threads.
template <typename T>
int64_t PackCostDiv(BitIsa isa) {
  return isa == BitIsa::kAvx512 && std::is_same_v<T, float> ? 4 : 1;
}

// Signs of W as [row_words][n_pad] words (columns >= N are zeros; the AVX2
// tier keeps them as nibble panels instead), each tap's popcount (what a
// zero padding tap adds to a count) and alpha, packed on the tier the
// kernels pick now.
template <typename T>
BitFilter<T> PackBitFilterImpl(const ConvShape& s, const T* w, Scale scale,
                               Impl impl, const ParallelFor& parallel_for) {
  const BitIsa isa = BitIsaOf(impl);
  const int64_t C = s.in_c, N = s.out_c;
  const int64_t cw = WordsPerPixel(s);
  const int64_t taps = s.k_h * s.k_w;
  BitFilter<T> f;
  f.k_h = s.k_h, f.k_w = s.k_w, f.in_c = C, f.out_c = N;
  f.scale = scale;
  f.isa = static_cast<int>(isa);
  f.n_pad = RoundUp(N, kPopColTile);
  const int64_t n_pad = f.n_pad;
  const int64_t tap_cost = C * N / PackCostDiv<T>(isa) + 1;
  f.words.assign(taps * cw * n_pad, 0);
  f.tap_count.assign(taps * N, 0);
  std::vector<uint64_t>& wb = f.words;
  std::vector<int32_t>& tap_count = f.tap_count;
  // One tap per unit, which also sums |W| per output channel for alpha
  // (per tap, then over taps in order: independent of the sharding).
  const bool mean_abs = scale == Scale::kMeanAbs;
  std::vector<double> abs_sum(mean_abs ? taps * N : 0, 0.0);
  parallel_for(taps, tap_cost, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#if TAPEHOOK_HAVE_AVX512_PATH
      if constexpr (std::is_same_v<T, float>) {
        if (isa == BitIsa::kAvx512) {
          auto* pack = mean_abs ? simd::PackWeightTap512<true>
                                : simd::PackWeightTap512<false>;
          pack(w + t * C * N, C, N, &wb[t * cw * n_pad], n_pad,
               &tap_count[t * N], mean_abs ? &abs_sum[t * N] : nullptr);
          continue;
        }
      }
#endif
      for (int64_t c = 0; c < C; ++c) {
        PackWeightSigns(isa, w + (t * C + c) * N, N, static_cast<int>(c % 64),
                        &wb[(t * cw + c / 64) * n_pad],
                        mean_abs ? &abs_sum[t * N] : nullptr);
      }
      for (int64_t k = t * cw; k < (t + 1) * cw; ++k) {
        for (int64_t o = 0; o < N; ++o) {
          tap_count[t * N + o] += __builtin_popcountll(wb[k * n_pad + o]);
        }
      }
    }
  });
  if (isa == BitIsa::kAvx2) {
    f.nibbles = NibblePanels(f.words, taps * cw, n_pad);
    f.words = std::vector<uint64_t>();
  }
  f.alpha.assign(N, T(1));
  for (int64_t o = 0; o < N && mean_abs; ++o) {
    double sum = 0;
    for (int64_t t = 0; t < taps; ++t) sum += abs_sum[t * N + o];
    f.alpha[o] = static_cast<T>(sum / static_cast<double>(taps * C));
  }
  return f;
}

// Words per input pixel of x's signs on the AVX2 and portable tiers: cw
// words, or on the AVX2 tier their nibble form (2 cw).
inline int64_t TierPixelWords(BitIsa isa, const ConvShape& s) {
  return isa == BitIsa::kAvx2 ? 2 * WordsPerPixel(s) : WordsPerPixel(s);
}

// The AVX2 and portable tiers' forward from x's signs already packed, in
// the tier's form (xb: TierPixelWords per input pixel, 1 bits negative):
// y = alpha_t * dot, or with an offset fma(alpha_t, relu ? max(dot, 0) :
// dot, offset), then + addend where given.
template <typename T>
void BitpackedBlocks(const ConvShape& s, const uint64_t* xb,
                     const BitFilter<T>& f, T* y,
                     const ParallelFor& parallel_for, const T* alpha_t,
                     const T* offset, bool relu, const T* addend) {
  const int64_t C = s.in_c, N = s.out_c;
  const int64_t taps = s.k_h * s.k_w;
  const int64_t row_words = taps * WordsPerPixel(s);
  const int64_t n_pad = f.n_pad;
  const int64_t pixels = OutPixels(s);
  const BitIsa isa = static_cast<BitIsa>(f.isa);
  const uint64_t* const wb =
      isa == BitIsa::kAvx2 ? f.nibbles.data() : f.words.data();
  const int32_t* const tap_count = f.tap_count.data();
  const int64_t pw = TierPixelWords(isa, s);
  const int64_t blocks = (pixels + kBitPixelBlock - 1) / kBitPixelBlock;
  const int64_t col_words = taps * pw;  // per row of the bit im2col
  // A unit is a block's outputs in one slice of the AVX2 tier's column
  // panels: where blocks are few (batch 1, a late stage: 7x7 = 49 pixels is
  // one block), slices share the work out, each reading only its panels.
  constexpr int64_t kMinUnits = 16;
  const int64_t panels = n_pad / kPopColTile;
  const int64_t slices =
      isa == BitIsa::kAvx2
          ? std::min(panels,
                     std::max<int64_t>(1, (kMinUnits + blocks - 1) / blocks))
          : 1;
  parallel_for(
      blocks * slices, kBitPixelBlock * row_words * N / slices + 1,
      [&](int64_t u0, int64_t u1) {
        std::vector<uint64_t> col(kBitPixelBlock * col_words);
        std::vector<int32_t> counts(kBitPixelBlock * n_pad);
        std::vector<char> border(kBitPixelBlock);
        // Calls f(t, ih, iw, inside) for each tap of output pixel q.
        auto for_each_tap = [&](const PixelPos& q, auto f) {
          for (int64_t kh = 0, t = 0; kh < s.k_h; ++kh) {
            const int64_t ih = q.oh * s.stride_h - s.pad_top + kh * s.dil_h;
            for (int64_t kw = 0; kw < s.k_w; ++kw, ++t) {
              const int64_t iw = q.ow * s.stride_w - s.pad_left + kw * s.dil_w;
              f(t, ih, iw, ih >= 0 && ih < s.in_h && iw >= 0 && iw < s.in_w);
            }
          }
        };
        int64_t built = -1;  // the block whose bits `col` holds
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t b = u / slices, slice = u % slices;
          const int64_t pix0 = b * kBitPixelBlock;
          const int64_t np = std::min(kBitPixelBlock, pixels - pix0);
          // Columns [j0, j1) of the panels; outputs [j0, c1).
          const int64_t j0 = panels * slice / slices * kPopColTile;
          const int64_t j1 = panels * (slice + 1) / slices * kPopColTile;
          const int64_t c1 = std::min(j1, N);
          PixelPos q = Pos(s, pix0);
          for (int64_t p = 0; p < np && built != b; ++p) {
            const uint64_t* xn = &xb[q.n * s.in_h * s.in_w * pw];
            uint64_t* row = &col[p * col_words];
            const int64_t ih0 = q.oh * s.stride_h - s.pad_top;
            const int64_t iw0 = q.ow * s.stride_w - s.pad_left;
            border[p] = ih0 < 0 || ih0 + (s.k_h - 1) * s.dil_h >= s.in_h ||
                        iw0 < 0 || iw0 + (s.k_w - 1) * s.dil_w >= s.in_w;
            if (!border[p] && s.dil_w == 1) {
              // Interior: each kernel row is one run of k_w * pw words.
              for (int64_t kh = 0; kh < s.k_h; ++kh) {
                const int64_t ih = ih0 + kh * s.dil_h;
                std::copy_n(xn + (ih * s.in_w + iw0) * pw, s.k_w * pw,
                            row + kh * s.k_w * pw);
              }
            } else {
              for_each_tap(q,
                           [&](int64_t t, int64_t ih, int64_t iw, bool inside) {
                             const uint64_t* src = xn + (ih * s.in_w + iw) * pw;
                             for (int64_t k = 0; k < pw; ++k) {
                               row[t * pw + k] = inside ? src[k] : 0;
                             }
                           });
            }
            if (++q.ow == s.out_w) {
              q.ow = 0;
              if (++q.oh == s.out_h) q.oh = 0, ++q.n;
            }
          }
          built = b;
#if TAPEHOOK_HAVE_AVX2_PATH
          if (isa == BitIsa::kAvx2) {
            simd::XorPopcountNibbles(np, j1 - j0, row_words, col.data(),
                                     wb + j0 * row_words * 2,
                                     counts.data() + j0, n_pad);
          } else
#endif
          {
            XorPopcountPortable(np, n_pad, row_words, col.data(), wb,
                                counts.data(), n_pad);
          }
          // dot = sum over valid taps of (C - 2 * mismatches). A padding tap
          // has zero x bits, so it counted popcount(W tap): take that back out.
          for (int64_t p = 0; p < np; ++p) {
            int32_t* cnt = &counts[p * n_pad];
            int64_t valid = taps;
            if (border[p]) {
              for_each_tap(Pos(s, pix0 + p),
                           [&](int64_t t, int64_t, int64_t, bool inside) {
                             if (inside) return;
                             --valid;
                             const int32_t* tc = &tap_count[t * N];
                             for (int64_t o = j0; o < c1; ++o) cnt[o] -= tc[o];
                           });
            }
            // Exact in int32 and in T (|dot| < 2^24 for any real layer).
            const int32_t all_match = static_cast<int32_t>(valid * C);
            T* out = y + (pix0 + p) * N;
            const T* add =
                addend != nullptr ? addend + (pix0 + p) * N : nullptr;
#if TAPEHOOK_HAVE_AVX2_PATH
            if constexpr (std::is_same_v<T, float>) {
              if (isa == BitIsa::kAvx2) {
                simd::CountsToOutputs(cnt + j0, all_match, alpha_t + j0,
                                      offset != nullptr ? offset + j0 : nullptr,
                                      relu, add != nullptr ? add + j0 : nullptr,
                                      c1 - j0, out + j0);
                continue;
              }
            }
#endif
            if (offset == nullptr) {
              for (int64_t o = j0; o < c1; ++o) {
                out[o] = alpha_t[o] * static_cast<T>(all_match - 2 * cnt[o]);
              }
            } else {
              for (int64_t o = j0; o < c1; ++o) {
                const int32_t dot = all_match - 2 * cnt[o];
                // Rounded to T (a store), then the addend: a separate add's
                // sum.
                const T v = std::fma(
                    alpha_t[o], static_cast<T>(relu ? std::max(dot, 0) : dot),
                    offset[o]);
                out[o] = add != nullptr ? v + add[o] : v;
              }
            }
          }
        }
      });
}

// The bitpacked forward given its packed filter (packed on f.isa's tier),
// its outputs transformed by `affine` where given, x binarized at the
// per-channel threshold `thr` ([in_c]) where given.
template <typename T>
void BitpackedForwardWith(const ConvShape& s, const T* x, const BitFilter<T>& f,
                          T* y, const ParallelFor& parallel_for,
                          const OutputAffine<T>* affine = nullptr,
                          const T* thr = nullptr) {
  const int64_t C = s.in_c, N = s.out_c;
  const int64_t cw = WordsPerPixel(s);
  const BitIsa isa = static_cast<BitIsa>(f.isa);
  // The transform's multiplier folds into alpha (one multiply per output).
  std::vector<T> folded;
  if (affine != nullptr) {
    folded.resize(N);
    for (int64_t o = 0; o < N; ++o)
      folded[o] = f.alpha[o] * affine->multiplier[o];
  }
  const T* const alpha_t = affine != nullptr ? folded.data() : f.alpha.data();
  const T* const offset = affine != nullptr ? affine->offset : nullptr;
  const bool relu = affine != nullptr && affine->relu;
  const T* const addend = affine != nullptr ? affine->addend : nullptr;
  const int64_t pixel_cost = C / PackCostDiv<T>(isa) + 1;

#if TAPEHOOK_HAVE_AVX512_PATH
  // Unless x is small, the AVX-512 tier packs it inside its units.
  const BitInput input = isa == BitIsa::kAvx512 && std::is_same_v<T, float>
                             ? PickBitInput(s)
                             : BitInput::kPacked;
  const bool packed = input == BitInput::kPacked;
#else
  const bool packed = true;
#endif

  // Signs of x, one run of pw words per input pixel: cw words, or on the
  // AVX2 tier their nibble form (2 cw).
  const int64_t pw = TierPixelWords(isa, s);
  const int64_t in_pixels = packed ? s.batch * s.in_h * s.in_w : 0;
  std::unique_ptr<uint64_t[]> xb(new uint64_t[in_pixels * pw]);
  parallel_for(in_pixels, pixel_cost, [&](int64_t p0, int64_t p1) {
#if TAPEHOOK_HAVE_AVX512_PATH
    if constexpr (std::is_same_v<T, float>) {
      if (isa == BitIsa::kAvx512) {
        return simd::PackSigns512(x + p0 * C, p1 - p0, C, &xb[p0 * cw], thr);
      }
    }
#endif
    for (int64_t p = p0; p < p1; ++p) {
      PackSigns(isa, x + p * C, C, &xb[p * pw], thr);
      if (pw != cw) SplitNibbles(&xb[p * pw], cw);
    }
  });

#if TAPEHOOK_HAVE_AVX512_PATH
  if (isa == BitIsa::kAvx512) {
    return BitpackedBlocks512(s, input, x, xb.get(), f.words.data(), f.n_pad,
                              f.tap_count.data(), alpha_t, y, parallel_for,
                              offset, relu, addend, thr);
  }
#endif

  BitpackedBlocks(s, xb.get(), f, y, parallel_for, alpha_t, offset, relu,
                  addend);
}

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_BITPACKED_H_
