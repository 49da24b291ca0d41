// Sign-table dW on AVX2 (see lut_backprop_avx2.h for the idea).
//
// Sign convention of every index: bit 1 <=> -1 (t < 0 or NaN), bit 0 <=> +1.
#include "lut_backprop_avx2.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu.h"
#include "lut_common.h"
#include "pack_input.h"
#include "simd_avx2.h"

namespace tapehook {
namespace lut_avx2 {

bool Usable() { return TAPEHOOK_HAVE_AVX2_PATH && cpu::Avx2(); }

#if TAPEHOOK_HAVE_AVX2_PATH

namespace {

using lut_common::DwTaps;
using lut_common::kNegSigns;
using lut_common::PaddingCorrection;
using lut_common::Scratch;
using lut_common::TapsOf;

// Position groups per K chunk: a tile's tables (at most 3 x 512 bytes a
// group) stay in L1 while every tap and input channel reads them (chosen
// among 8 / 16 / 24 / 32 by bench/backprops.py --plans avx2).
constexpr int64_t kChunk = 16;
// A table: 16 entries of 8 output channels (one 8-lane output channel
// block), 512 bytes. A tile spans at most 3 blocks (12 accumulators).
constexpr int kEntries = 16;
constexpr int64_t kTableBytes = kEntries * 8 * sizeof(float);
constexpr int64_t kMaxBlocks = 3;

struct Geometry {
  int64_t n, h, w, ci, oh, ow, co, kh, kw, sh, sw, pt, pl;
  int64_t cb;   // bytes of sign bits per pixel (8 channels each)
  int64_t cob;  // 8-lane output channel blocks
  // A position group is 4 positions whose dy one table sums: one output
  // pixel in 4 consecutive images, or (by_cols) 4 consecutive output columns
  // of one image, whichever makes fewer groups (batch 32: images; batch 1:
  // columns). Empty slots (past the batch or the row) have dy = 0.
  bool by_cols;
  int64_t nq;        // image slots: quads of images, or images (by_cols)
  int64_t gw;        // groups per output row: ow, or ceil(ow / 4) (by_cols)
  int64_t slot;      // dy floats from one slot to the next
  int64_t nih, niw;  // the quad image's rows and columns
};

Geometry GeometryOf(const ConvShape& s) {
  Geometry g;
  g.n = s.batch, g.h = s.in_h, g.w = s.in_w, g.ci = s.in_c;
  g.oh = s.out_h, g.ow = s.out_w, g.co = s.out_c, g.kh = s.k_h, g.kw = s.k_w;
  g.sh = s.stride_h, g.sw = s.stride_w, g.pt = s.pad_top, g.pl = s.pad_left;
  g.cb = (g.ci + 7) / 8;
  g.cob = (g.co + 7) / 8;
  const int64_t by_images = (g.n + 3) / 4 * g.ow;
  g.by_cols = g.n * ((g.ow + 3) / 4) < by_images;
  g.nq = g.by_cols ? g.n : (g.n + 3) / 4;
  g.gw = g.by_cols ? (g.ow + 3) / 4 : g.ow;
  g.slot = g.by_cols ? g.co : g.oh * g.ow * g.co;
  g.nih = (g.oh - 1) * g.sh + g.kh;
  g.niw = (g.ow - 1) * g.sw + g.kw;
  return g;
}

// kSpread.v[m]: byte k of the word = bit k of m (a byte of 8 channels' sign
// bits to one byte per channel).
struct Spread {
  uint64_t v[256];
  Spread() {
    for (int m = 0; m < 256; ++m) {
      uint64_t u = 0;
      for (int k = 0; k < 8; ++k) u |= uint64_t((m >> k) & 1) << (8 * k);
      v[m] = u;
    }
  }
};
const Spread kSpread;

// Signs of x, 8 channels to a byte (bit 1 <=> -1, 0 past ci): pixels
// [p0, p1) of a float x.
TAPEHOOK_AVX2 void SignsOfFloats(const float* x, int64_t ci, int64_t cb,
                                 int64_t p0, int64_t p1, uint8_t* bits) {
  const __m256 zero = _mm256_setzero_ps();
  const int64_t full = ci / 8;
  for (int64_t p = p0; p < p1; ++p) {
    const float* xr = x + p * ci;
    for (int64_t j = 0; j < full; ++j) {
      const __m256 v = _mm256_loadu_ps(xr + 8 * j);
      bits[p * cb + j] = static_cast<uint8_t>(
          _mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NGE_UQ)));
    }
    if (full < cb) {
      unsigned m = 0;
      for (int64_t c = 8 * full; c < ci; ++c) {
        m |= unsigned{!(xr[c] >= 0.0f)} << (c - 8 * full);
      }
      bits[p * cb + full] = static_cast<uint8_t>(m);
    }
  }
}

// The same from the packed format (two packed bytes per 8 channels).
void SignsOfPacked(const uint8_t* packed, int64_t ci, int64_t cb, int64_t p0,
                   int64_t p1, uint8_t* bits) {
  const int64_t row_bytes = PackedBytes(ci);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* r = packed + p * row_bytes;
    for (int64_t j = 0; j < cb; ++j) {
      unsigned m = kNegSigns.v[r[2 * j]];
      if (2 * j + 1 < row_bytes) m |= unsigned{kNegSigns.v[r[2 * j + 1]]} << 4;
      const int64_t valid = std::min<int64_t>(8, ci - 8 * j);
      if (valid < 8) m &= (1u << valid) - 1;
      bits[p * cb + j] = static_cast<uint8_t>(m);
    }
  }
}

// Quad image QI[nq][r][c][ci] uint16, r = ih + pt in [0, nih), c = iw + pl
// in [0, niw): the byte offset of the table entry x selects, 32 j with bit i
// of j = sign bit of x(4 q + i, ih, iw), or by_cols of x(q, ih, iw + i sw)
// (0, i.e. +1, outside the image or past the batch). Rows nr = q * nih + r
// in [r0, r1).
TAPEHOOK_AVX2 void QuadRows(const Geometry& g, const uint8_t* bits, int64_t r0,
                            int64_t r1, uint16_t* qi) {
  const int64_t full = g.ci / 8;
  for (int64_t nr = r0; nr < r1; ++nr) {
    const int64_t q = nr / g.nih, ih = nr % g.nih - g.pt;
    uint16_t* row = qi + nr * g.niw * g.ci;
    if (ih < 0 || ih >= g.h) {
      std::memset(row, 0, sizeof(uint16_t) * g.niw * g.ci);
      continue;
    }
    for (int64_t c = 0; c < g.niw; ++c) {
      uint16_t* out = row + c * g.ci;
      // The slots' sign bytes (a slot outside the image or the batch: none).
      const uint8_t* xr[4];
      int mask = 0;
      for (int i = 0; i < 4; ++i) {
        const int64_t n = g.by_cols ? q : 4 * q + i;
        const int64_t iw = c - g.pl + (g.by_cols ? i * g.sw : 0);
        if (n >= g.n || iw < 0 || iw >= g.w) continue;
        xr[i] = bits + ((n * g.h + ih) * g.w + iw) * g.cb;
        mask |= 1 << i;
      }
      if (mask == 0) {
        std::memset(out, 0, sizeof(uint16_t) * g.ci);
        continue;
      }
      for (int64_t j = 0; j < g.cb; ++j) {
        uint64_t idx = 0;  // byte k: the entry index of channel 8 j + k
        for (int i = 0; i < 4; ++i) {
          if (mask >> i & 1) idx |= kSpread.v[xr[i][j]] << i;
        }
        const __m128i v = _mm_slli_epi16(
            _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(idx))), 5);
        if (j < full) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8 * j), v);
        } else {
          alignas(16) uint16_t tail[8];
          _mm_store_si128(reinterpret_cast<__m128i*>(tail), v);
          std::memcpy(out + 8 * j, tail, sizeof(uint16_t) * (g.ci - 8 * j));
        }
      }
    }
  }
}

// The 16 entries of one position group's table for one output channel
// block: entry j = sum_i (bit i of j ? -d_i : +d_i), summed in image order.
TAPEHOOK_AVX2 inline void MakeTable(__m256 d0, __m256 d1, __m256 d2, __m256 d3,
                                    float* t) {
  __m256 e[16];
  e[0] = d0;
  e[1] = _mm256_sub_ps(_mm256_setzero_ps(), d0);
  const __m256 d[3] = {d1, d2, d3};
#pragma GCC unroll 3
  for (int i = 0; i < 3; ++i) {
    const int half = 2 << i;
#pragma GCC unroll 8
    for (int j = half - 1; j >= 0; --j) {
      e[j + half] = _mm256_sub_ps(e[j], d[i]);
      e[j] = _mm256_add_ps(e[j], d[i]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) _mm256_store_ps(t + 8 * j, e[j]);
}

// CI input channels x CB output channel blocks, over ngroups position
// groups. Group gi's entry for input channel i of block b is the 8 floats at
// byte tab + gi * tab_stride + b * 512 + qi[goff[gi] + tapoff + i]. acc:
// CI rows of CB * 8 floats, acc_stride floats apart.
template <int CI, int CB>
TAPEHOOK_AVX2 void Tile(const uint16_t* qi, const int64_t* goff, int64_t tapoff,
                        const char* tab, int64_t tab_stride, int64_t ngroups,
                        float* acc_out, int64_t acc_stride) {
  __m256 acc[CI][CB];
#pragma GCC unroll 12
  for (int i = 0; i < CI; ++i) {
#pragma GCC unroll 3
    for (int b = 0; b < CB; ++b) {
      acc[i][b] = _mm256_loadu_ps(acc_out + i * acc_stride + b * 8);
    }
  }
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    const uint16_t* ip = qi + goff[gi] + tapoff;
    const char* tp = tab + gi * tab_stride;
#pragma GCC unroll 12
    for (int i = 0; i < CI; ++i) {
      const char* e = tp + ip[i];
#pragma GCC unroll 3
      for (int b = 0; b < CB; ++b) {
        acc[i][b] = _mm256_add_ps(acc[i][b],
                                  _mm256_load_ps(reinterpret_cast<const float*>(
                                      e + b * kTableBytes)));
      }
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < CI; ++i) {
#pragma GCC unroll 3
    for (int b = 0; b < CB; ++b) {
      _mm256_storeu_ps(acc_out + i * acc_stride + b * 8, acc[i][b]);
    }
  }
}

using TileFn = void (*)(const uint16_t*, const int64_t*, int64_t, const char*,
                        int64_t, int64_t, float*, int64_t);

template <int CB, int... Is>
void FillTiles(TileFn* table, std::integer_sequence<int, Is...>) {
  ((table[Is + 1] = &Tile<Is + 1, CB>), ...);
}

// kTiles.k[CB][CI]: CI <= 12 / CB input channels (12 accumulators; the
// table loads fold into the adds).
struct Tiles {
  TileFn k[kMaxBlocks + 1][13] = {};
  Tiles() {
    FillTiles<1>(k[1], std::make_integer_sequence<int, 12>());
    FillTiles<2>(k[2], std::make_integer_sequence<int, 6>());
    FillTiles<3>(k[3], std::make_integer_sequence<int, 4>());
  }
};
const Tiles kTiles;

// dW columns of the output channel blocks [b0, b0 + nb), nb <= kMaxBlocks:
// acc[tap][ci][nb * 8] over K chunks of position groups, then the padding
// correction and the copy into HWIO.
TAPEHOOK_AVX2 void Columns(const Geometry& g, const DwTaps& taps,
                           const uint16_t* qi, const float* dy, int64_t b0,
                           int64_t nb, float* dw) {
  const int64_t ntaps = g.kh * g.kw;
  const int64_t total_groups = g.nq * g.oh * g.gw;
  const int64_t qi_img = g.nih * g.niw * g.ci;
  const int64_t co0 = 8 * b0;
  const int64_t cols = std::min<int64_t>(8 * nb, g.co - co0);
  const int64_t width = 8 * nb;
  const int64_t ci_tile = 12 / nb;
  const int64_t tab_stride = nb * kTableBytes;
  Scratch<float> tab(kChunk * nb * kEntries * 8);
  Scratch<float> acc(ntaps * g.ci * width);
  std::vector<int64_t> goff(kChunk);
  std::vector<float> corr(ntaps * width);
  std::vector<float> border_sum(taps.border.size() * width);
  std::memset(acc.get(), 0, sizeof(float) * ntaps * g.ci * width);
  // dy lanes past co read as 0 (only the last block can have them).
  alignas(32) int32_t lane_mask[8];
  for (int k = 0; k < 8; ++k) lane_mask[k] = 8 * (nb - 1) + k < cols ? -1 : 0;
  const __m256i tail_mask =
      _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_mask));
  const TileFn* tiles = kTiles.k[nb];
  for (int64_t k0 = 0; k0 < total_groups; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, total_groups - k0);
    for (int64_t gi = 0; gi < kc; ++gi) {
      const int64_t gg = k0 + gi;
      const int64_t q = gg / (g.oh * g.gw), pix = gg % (g.oh * g.gw);
      const int64_t o = pix / g.gw, x = pix % g.gw * (g.by_cols ? 4 : 1);
      goff[gi] = q * qi_img + (o * g.sh * g.niw + x * g.sw) * g.ci;
      // Slot 0's dy (image 4 q, or image q at column x) and the filled slots.
      const int64_t n0 = g.by_cols ? q : 4 * q;
      const float* d = dy + ((n0 * g.oh + o) * g.ow + x) * g.co + co0;
      const int64_t filled =
          std::min<int64_t>(4, g.by_cols ? g.ow - x : g.n - 4 * q);
      for (int64_t b = 0; b < nb; ++b) {
        __m256 v[4];
        for (int64_t i = 0; i < 4; ++i) {
          if (i >= filled) {
            v[i] = _mm256_setzero_ps();
          } else if (8 * b + 8 <= cols) {
            v[i] = _mm256_loadu_ps(d + i * g.slot + 8 * b);
          } else {
            v[i] = _mm256_maskload_ps(d + i * g.slot + 8 * b, tail_mask);
          }
        }
        MakeTable(v[0], v[1], v[2], v[3],
                  tab.get() + (gi * nb + b) * kEntries * 8);
      }
    }
    for (int64_t tap = 0; tap < ntaps; ++tap) {
      if (!taps.live[tap]) continue;
      const int64_t tapoff = (tap / g.kw * g.niw + tap % g.kw) * g.ci;
      for (int64_t i0 = 0; i0 < g.ci; i0 += ci_tile) {
        const int64_t ni = std::min(ci_tile, g.ci - i0);
        tiles[ni](qi + i0, goff.data(), tapoff,
                  reinterpret_cast<const char*>(tab.get()), tab_stride, kc,
                  acc.get() + (tap * g.ci + i0) * width, width);
      }
    }
  }
  // Zero padding: the kernel counted padded taps as +1; subtract
  // corr[tap][co] = the sum of dy over the positions where tap is padding.
  PaddingCorrection(g, taps, dy, co0, cols, width, &border_sum, &corr);
  // acc[tap][ci][co] minus corr into dw[tap][ci][co]; taps that never meet
  // the input are exact zeros.
  for (int64_t tap = 0; tap < ntaps; ++tap) {
    const float* cv = corr.data() + tap * width;
    for (int64_t i = 0; i < g.ci; ++i) {
      float* out = dw + (tap * g.ci + i) * g.co + co0;
      if (!taps.live[tap]) {
        std::fill_n(out, cols, 0.0f);
        continue;
      }
      const float* a = acc.get() + (tap * g.ci + i) * width;
      for (int64_t c = 0; c < cols; ++c) out[c] = a[c] - cv[c];
    }
  }
}

// dW from the sign bits of x ([pixel][cb] bytes).
void FilterFromSigns(const Geometry& g, const uint8_t* bits, const float* dy,
                     float* dw, const ParallelFor& parallel_for) {
  Scratch<uint16_t> qi(g.nq * g.nih * g.niw * g.ci);
  parallel_for(g.nq * g.nih, g.niw * g.ci * 2, [&](int64_t r0, int64_t r1) {
    QuadRows(g, bits, r0, r1, qi.get());
  });
  const DwTaps taps = TapsOf(g);
  // Output channel blocks, one even shard per thread (each tile of a shard
  // reads the whole quad image), in tiles of at most 3 blocks, as even as the
  // shard allows (4 blocks: 2 + 2).
  parallel_for(g.cob, kEvenShards, [&](int64_t u0, int64_t u1) {
    const int64_t blocks = u1 - u0;
    const int64_t ntiles = (blocks + kMaxBlocks - 1) / kMaxBlocks;
    int64_t b = u0;
    for (int64_t t = 0; t < ntiles; ++t) {
      const int64_t nb = blocks / ntiles + (t < blocks % ntiles ? 1 : 0);
      Columns(g, taps, qi.get(), dy, b, nb, dw);
      b += nb;
    }
  });
}

// Whether the engine runs this conv now (with every size known).
bool Runs(const ConvShape& s) {
  return Usable() && s.dil_h == 1 && s.dil_w == 1 && s.batch > 0 &&
         s.in_h > 0 && s.in_w > 0 && s.in_c > 0 && s.out_c > 0 && s.out_h > 0 &&
         s.out_w > 0 && s.k_h > 0 && s.k_w > 0;
}

// The engine on the sign bits that signs(g, p0, p1, bits) writes for
// pixels [p0, p1) of x; false where it does not run (Runs).
template <typename SignsFn>
bool FromInput(const ConvShape& s, const float* dy, float* dw,
               const ParallelFor& parallel_for, const SignsFn& signs) {
  if (!Runs(s)) return false;
  const Geometry g = GeometryOf(s);
  const int64_t pixels = g.n * g.h * g.w;
  Scratch<uint8_t> bits(pixels * g.cb);
  parallel_for(pixels, g.ci,
               [&](int64_t p0, int64_t p1) { signs(g, p0, p1, bits.get()); });
  FilterFromSigns(g, bits.get(), dy, dw, parallel_for);
  return true;
}

}  // namespace

bool BackpropFilter(const ConvShape& s, const float* x, const float* dy,
                    float* dw, const ParallelFor& parallel_for) {
  return FromInput(
      s, dy, dw, parallel_for,
      [&](const Geometry& g, int64_t p0, int64_t p1, uint8_t* bits) {
        SignsOfFloats(x, g.ci, g.cb, p0, p1, bits);
      });
}

bool BackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                          const float* dy, float* dw,
                          const ParallelFor& parallel_for) {
  return FromInput(
      s, dy, dw, parallel_for,
      [&](const Geometry& g, int64_t p0, int64_t p1, uint8_t* bits) {
        SignsOfPacked(packed, g.ci, g.cb, p0, p1, bits);
      });
}

#else  // !TAPEHOOK_HAVE_AVX2_PATH

bool BackpropFilter(const ConvShape&, const float*, const float*, float*,
                    const ParallelFor&) {
  return false;
}
bool BackpropFilterPacked(const ConvShape&, const uint8_t*, const float*,
                          float*, const ParallelFor&) {
  return false;
}

#endif  // TAPEHOOK_HAVE_AVX2_PATH

}  // namespace lut_avx2
}  // namespace tapehook
