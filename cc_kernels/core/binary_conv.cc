// Binary Conv2D kernels: im2col / col2im around one small register-blocked
// GEMM. Plain portable C++17; the inner loops are written so that -O3
// vectorizes them without any -march flags.
#include "binary_conv.h"
#include "amx_conv.h"
#include "simd_avx2.h"
#include "simd_avx512.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

namespace tapehook {

bool ParseEstimator(const std::string& name, Estimator* out) {
  if (name == "none") {
    *out = Estimator::kNone;
  } else if (name == "ste_sign") {
    *out = Estimator::kSteSign;
  } else if (name == "approx_sign") {
    *out = Estimator::kApproxSign;
  } else if (name == "swish_sign") {
    *out = Estimator::kSwishSign;
  } else {
    return false;
  }
  return true;
}

bool ParseScale(const std::string& name, Scale* out) {
  if (name == "none") {
    *out = Scale::kNone;
  } else if (name == "mean_abs") {
    *out = Scale::kMeanAbs;
  } else {
    return false;
  }
  return true;
}

double EstimatorGrad(Estimator e, double t, double clip) {
  switch (e) {
    case Estimator::kNone:
      return 1.0;
    case Estimator::kSteSign:
      return std::abs(t) <= clip ? 1.0 : 0.0;
    case Estimator::kApproxSign:
      return std::abs(t) <= 1.0 ? 2.0 - 2.0 * std::abs(t) : 0.0;
    case Estimator::kSwishSign: {
      constexpr double kBeta = 5.0;
      const double bt = kBeta * t;
      const double ch = std::cosh(bt);
      // The true value underflows long before cosh overflows; inf / inf
      // would otherwise give NaN.
      if (!std::isfinite(ch)) return 0.0;
      return kBeta * (2.0 - bt * std::tanh(bt / 2.0)) / (1.0 + ch);
    }
  }
  return 1.0;
}

namespace {

// Output size and leading pad along one spatial axis, as TF computes them.
std::string AxisGeometry(const char* axis, Padding padding, int64_t in,
                         int64_t k, int64_t stride, int64_t dil,
                         int64_t pad_before, int64_t pad_after, int64_t* out,
                         int64_t* pad) {
  const std::string where = std::string(" along ") + axis;
  if (stride < 1) return "stride must be >= 1" + where;
  if (dil < 1) return "dilation must be >= 1" + where;
  if (in < 0) return "input size must be >= 0" + where;
  if (k < 1) return "filter size must be >= 1" + where;
  const int64_t ek = (k - 1) * dil + 1;
  switch (padding) {
    case Padding::kValid:
      if (in < ek) {
        return "VALID padding needs input size (" + std::to_string(in) +
               ") >= effective filter size (" + std::to_string(ek) + ")" +
               where;
      }
      *out = (in - ek + stride) / stride;
      *pad = 0;
      return "";
    case Padding::kSame: {
      *out = (in + stride - 1) / stride;
      const int64_t total = std::max<int64_t>((*out - 1) * stride + ek - in, 0);
      *pad = total / 2;
      return "";
    }
    case Padding::kExplicit:
      if (pad_before < 0 || pad_after < 0) {
        return "explicit paddings must be >= 0" + where;
      }
      if (in + pad_before + pad_after < ek) {
        return "padded input size (" +
               std::to_string(in + pad_before + pad_after) +
               ") is smaller than effective filter size (" +
               std::to_string(ek) + ")" + where;
      }
      *out = (in + pad_before + pad_after - ek) / stride + 1;
      *pad = pad_before;
      return "";
  }
  return "unknown padding";
}

}  // namespace

std::string ComputeConvGeometry(Padding padding, int64_t pad_t, int64_t pad_b,
                                int64_t pad_l, int64_t pad_r, ConvShape* s) {
  if (s->batch < 0) return "batch must be >= 0";
  if (s->in_c < 1 || s->out_c < 1) {
    return "filter must not have zero elements (in_c and out_c >= 1)";
  }
  std::string err =
      AxisGeometry("height", padding, s->in_h, s->k_h, s->stride_h, s->dil_h,
                   pad_t, pad_b, &s->out_h, &s->pad_top);
  if (!err.empty()) return err;
  return AxisGeometry("width", padding, s->in_w, s->k_w, s->stride_w,
                      s->dil_w, pad_l, pad_r, &s->out_w, &s->pad_left);
}

namespace {

// Output pixels per im2col block: a [P, K] block stays in L2; a multiple
// of both GEMM tiles' row counts (4 and 6).
constexpr int64_t kPixelBlock = 48;
// BackpropFilter's GEMM has depth = pixels; longer blocks amortize the loads
// and stores of its accumulator (the unit's rows of dW).
constexpr int64_t kFilterPixelBlock = 256;
// Depth of one GEMM pass, so the panels of A and B a tile reads stay in L1.
constexpr int64_t kDepthBlock = 128;
// Columns of B per pass: a [kDepthBlock, kColumnBlock] slice is 128 KiB.
constexpr int64_t kColumnBlock = 256;
// Input channels per BackpropFilter work unit (one tap times this many
// channels are the unit's rows of dW).
constexpr int64_t kFilterChannelBlock = 64;

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

template <typename T>
inline T Sign(T t) {
  return t >= T(0) ? T(1) : T(-1);
}

// Portable register tile of the GEMM: kMR rows by kNR columns of C, kNR
// being two 128-bit vectors (SSE2 is all that the portable build may assume).
template <typename T>
struct GemmTile {
  static constexpr int kMR = 4;
  static constexpr int kNR = 32 / sizeof(T);
};

// c[i, j] (+)= sum_k a[k][i] * b[k, j] for one tile, a being a packed
// [depth][MR] panel. With kFullN the tile is NR wide, its loops unroll
// fully and acc lives in registers. Rows >= mr of the panel are zeros and are
// computed but not stored.
template <typename T, int MR, int NR, bool kFullN>
inline void GemmTileKernel(int64_t depth, const T* a, const T* b, int64_t ldb,
                           T* c, int64_t ldc, bool accumulate, int mr,
                           int nr) {
  const int n = kFullN ? NR : nr;
  T acc[MR][NR] = {};
  if (accumulate) {
    for (int i = 0; i < mr; ++i) {
      for (int j = 0; j < n; ++j) acc[i][j] = c[i * ldc + j];
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    const T* ak = a + k * MR;
    const T* bk = b + k * ldb;
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < n; ++j) acc[i][j] += ak[i] * bk[j];
    }
  }
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < n; ++j) c[i * ldc + j] = acc[i][j];
  }
}

// Column width of the GEMM's register tile with the ISA in use.
template <typename T>
int GemmNR() {
#if TAPEHOOK_HAVE_AVX2_PATH
  if (simd::Avx2Usable()) return simd::GemmNR<T>();
#endif
  return GemmTile<T>::kNR;
}

// B[depth, n] (read through strides) packed as ceil(n / nr) panels of
// [depth][nr], zero-padded past n: the tile kernel then streams contiguous
// memory (rows of B a power-of-two apart would otherwise fall into a few L1
// sets). Weights and dY are packed once per kernel call.
template <typename T>
struct PackedB {
  int64_t depth = 0, n = 0, nr = 0;
  std::vector<T> data;
};

// Rows [k_begin, k_begin + depth) of a PackedB: the B of one GEMM.
template <typename T>
struct PackedRows {
  const PackedB<T>* b;
  int64_t k_begin, depth;
  int64_t n() const { return b->n; }
  int64_t nr() const { return b->nr; }
  const T* Panel(int64_t j0, int64_t k0) const {  // j0: a multiple of nr
    return b->data.data() + j0 * b->depth + (k_begin + k0) * b->nr;
  }
};

template <typename T>
PackedRows<T> AllRows(const PackedB<T>& b) {
  return {&b, 0, b.depth};
}

// Packs B into out (depth, n and the ISA's tile width), by parallel_for
// over panels.
template <typename T>
void PackB(int64_t depth, int64_t n, const T* b, int64_t b_rs, int64_t b_cs,
           const ParallelFor& parallel_for, PackedB<T>* out) {
  const int64_t nr = GemmNR<T>();
  out->depth = depth;
  out->n = n;
  out->nr = nr;
  out->data.resize(RoundUp(n, nr) * depth);
  parallel_for(RoundUp(n, nr) / nr, depth * nr, [&](int64_t p0, int64_t p1) {
    for (int64_t j0 = p0 * nr; j0 < p1 * nr; j0 += nr) {
      const int64_t cols = std::min(nr, n - j0);
      T* dst = out->data.data() + j0 * depth;
      for (int64_t k = 0; k < depth; ++k) {
        const T* src = b + k * b_rs + j0 * b_cs;
        for (int64_t j = 0; j < nr; ++j) {
          dst[k * nr + j] = j < cols ? src[j * b_cs] : T(0);
        }
      }
    }
  });
}

// C[m, n] (+)= A[m, depth] * B[depth, n] with an MR x NR register tile;
// full tiles go to full_tile (portable or AVX2), the ragged right edge to
// the portable kernel. C is row-major; A is read through strides so col*W,
// dY*W^T and col^T*dY all use this one routine, and packed into [depth][MR]
// panels so the tile kernel vectorizes across columns, not depth. Columns
// are blocked so the B panels that all row panels reuse stay in L2.
template <typename T, int MR, int NR, typename FullTile>
void GemmBlocked(int64_t m, const T* a, int64_t a_rs, int64_t a_cs,
                 const PackedRows<T>& b, T* c, int64_t ldc, bool accumulate,
                 FullTile full_tile) {
  T a_panel[kDepthBlock * MR];
  for (int64_t k0 = 0; k0 < b.depth; k0 += kDepthBlock) {
    const int64_t kc = std::min(kDepthBlock, b.depth - k0);
    const bool acc = accumulate || k0 > 0;
    for (int64_t jb = 0; jb < b.n(); jb += kColumnBlock) {
      const int64_t jb_end = std::min(b.n(), jb + kColumnBlock);
      for (int64_t i0 = 0; i0 < m; i0 += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, m - i0));
        const T* at = a + i0 * a_rs + k0 * a_cs;
        if (a_rs == 1 && mr == MR) {  // col^T of BackpropFilter: runs of MR
          for (int64_t k = 0; k < kc; ++k) {
            std::copy_n(at + k * a_cs, MR, a_panel + k * MR);
          }
        } else {
          for (int64_t k = 0; k < kc; ++k) {
            for (int i = 0; i < MR; ++i) {
              a_panel[k * MR + i] = i < mr ? at[i * a_rs + k * a_cs] : T(0);
            }
          }
        }
        for (int64_t j0 = jb; j0 < jb_end; j0 += NR) {
          const int nr = static_cast<int>(std::min<int64_t>(NR, jb_end - j0));
          T* ct = c + i0 * ldc + j0;
          if (nr == NR) {
            full_tile(kc, a_panel, b.Panel(j0, k0), NR, ct, ldc, acc, mr);
          } else {
            GemmTileKernel<T, MR, NR, false>(kc, a_panel, b.Panel(j0, k0), NR,
                                             ct, ldc, acc, mr, nr);
          }
        }
      }
    }
  }
}

template <typename T>
void Gemm(int64_t m, const T* a, int64_t a_rs, int64_t a_cs,
          const PackedRows<T>& b, T* c, int64_t ldc, bool accumulate) {
#if TAPEHOOK_HAVE_AVX2_PATH
  // PackB chose the tile width by the ISA in use: no second getenv here.
  if (b.nr() == simd::GemmNR<T>()) {
    GemmBlocked<T, simd::kGemmMR, simd::GemmNR<T>()>(
        m, a, a_rs, a_cs, b, c, ldc, accumulate, simd::GemmTile<T>);
    return;
  }
#endif
  constexpr int MR = GemmTile<T>::kMR, NR = GemmTile<T>::kNR;
  GemmBlocked<T, MR, NR>(
      m, a, a_rs, a_cs, b, c, ldc, accumulate,
      [](int64_t kc, const T* panel, const T* bt, int64_t ldb, T* ct,
         int64_t ldc_, bool acc, int mr) {
        GemmTileKernel<T, MR, NR, true>(kc, panel, bt, ldb, ct, ldc_, acc, mr,
                                        NR);
      });
}

int64_t FilterSize(const ConvShape& s) { return s.k_h * s.k_w * s.in_c; }
int64_t OutPixels(const ConvShape& s) { return s.batch * s.out_h * s.out_w; }

// alpha[o] per output channel.
template <typename T>
std::vector<double> Alpha(const ConvShape& s, const T* w, Scale scale) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  std::vector<double> alpha(N, 1.0);
  if (scale == Scale::kMeanAbs) {
    std::vector<double> sum(N, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t o = 0; o < N; ++o) sum[o] += std::abs(double(w[k * N + o]));
    }
    for (int64_t o = 0; o < N; ++o) alpha[o] = sum[o] / double(K);
  }
  return alpha;
}

// W_hat packed for the GEMM: the [K, out_c] matrix (HWIO flattened), or its
// transpose [out_c, K].
template <typename T>
PackedB<T> PackedSignedWeights(const ConvShape& s, const T* w, Scale scale,
                               bool transpose,
                               const ParallelFor& parallel_for) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  const std::vector<double> alpha = Alpha(s, w, scale);
  std::vector<T> w_hat(K * N);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t o = 0; o < N; ++o) {
      w_hat[k * N + o] = static_cast<T>(alpha[o]) * Sign(w[k * N + o]);
    }
  }
  PackedB<T> packed;
  PackB(transpose ? N : K, transpose ? K : N, w_hat.data(), transpose ? 1 : N,
        transpose ? N : 1, parallel_for, &packed);
  return packed;
}

// Decomposes a flat output pixel index into (n, oh, ow).
struct PixelPos {
  int64_t n, oh, ow;
};
inline PixelPos Pos(const ConvShape& s, int64_t pix) {
  const int64_t hw = s.out_h * s.out_w;
  const int64_t r = pix % hw;
  return {pix / hw, r / s.out_w, r % s.out_w};
}

// Row p of col [np, (tap1 - tap0) * (c1 - c0)] holds input channels
// [c0, c1) of kernel taps [tap0, tap1) (tap = kh * k_w + kw) of the
// receptive field of output pixel pix0 + p, laid out like the K axis of an
// HWIO filter. Taps in the padding are 0 (not sign(0)); x_hat = sign(x)
// when binary.
template <typename T>
void Im2Col(const ConvShape& s, const T* x, bool binary, int64_t pix0,
            int64_t np, int64_t tap0, int64_t tap1, int64_t c0, int64_t c1,
            T* col) {
  const int64_t C = s.in_c, width = c1 - c0;
  for (int64_t p = 0; p < np; ++p) {
    const PixelPos q = Pos(s, pix0 + p);
    const T* xn = x + q.n * s.in_h * s.in_w * C + c0;
    T* dst = col + p * (tap1 - tap0) * width;
    for (int64_t tap = tap0; tap < tap1; ++tap, dst += width) {
      const int64_t ih = q.oh * s.stride_h - s.pad_top + tap / s.k_w * s.dil_h;
      const int64_t iw =
          q.ow * s.stride_w - s.pad_left + tap % s.k_w * s.dil_w;
      if (ih < 0 || ih >= s.in_h || iw < 0 || iw >= s.in_w) {
        std::fill(dst, dst + width, T(0));
        continue;
      }
      const T* src = xn + (ih * s.in_w + iw) * C;
      if (binary) {
        for (int64_t c = 0; c < width; ++c) dst[c] = Sign(src[c]);
      } else {
        std::copy(src, src + width, dst);
      }
    }
  }
}

// Adds row p of dcol [np, K] into the input pixels that output pixel
// pix0 + p reads (the adjoint of Im2Col).
template <typename T>
void Col2ImAdd(const ConvShape& s, const T* dcol, int64_t pix0, int64_t np,
               T* dx) {
  const int64_t K = FilterSize(s);
  const int64_t C = s.in_c;
  for (int64_t p = 0; p < np; ++p) {
    const PixelPos q = Pos(s, pix0 + p);
    T* dxn = dx + q.n * s.in_h * s.in_w * C;
    const T* row = dcol + p * K;
    for (int64_t kh = 0; kh < s.k_h; ++kh) {
      const int64_t ih = q.oh * s.stride_h - s.pad_top + kh * s.dil_h;
      if (ih < 0 || ih >= s.in_h) continue;
      for (int64_t kw = 0; kw < s.k_w; ++kw) {
        const int64_t iw = q.ow * s.stride_w - s.pad_left + kw * s.dil_w;
        if (iw < 0 || iw >= s.in_w) continue;
        const T* src = row + (kh * s.k_w + kw) * C;
        T* dst = dxn + (ih * s.in_w + iw) * C;
        for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Fully binary forward: x_hat and sign(W) as bits, dot products by xor and
// popcount. Bit 1 means -1. Each input pixel's in_c signs fill whole 64-bit
// words (the bits past in_c are 0 in x and W, so their xor adds nothing); a
// row of the bit im2col holds the words of all taps, in HWIO order.

// Output pixels per bit-im2col block.
constexpr int64_t kBitPixelBlock = 64;

int64_t WordsPerPixel(const ConvShape& s) { return (s.in_c + 63) / 64; }

// Inner loops of one BitpackedForward call, picked once per call (the checks
// read TAPEHOOK_NO_AVX512 / TAPEHOOK_NO_AVX2).
enum class BitIsa { kPortable, kAvx2, kAvx512 };

BitIsa PickBitIsa() {
  if (simd::Avx512Usable()) return BitIsa::kAvx512;
  if (simd::Avx2Usable()) return BitIsa::kAvx2;
  return BitIsa::kPortable;
}

template <typename T>
void PackSignsPortable(const T* x, int64_t c, uint64_t* out) {
  for (int64_t w = 0; w * 64 < c; ++w) {
    uint64_t bits = 0;
    const int64_t n = std::min<int64_t>(64, c - w * 64);
    for (int64_t b = 0; b < n; ++b) {
      bits |= static_cast<uint64_t>(!(x[w * 64 + b] >= T(0))) << b;
    }
    out[w] = bits;
  }
}

// (The AVX-512 tier packs floats with simd::PackSigns512 and
// simd::PackWeightTap512, over whole runs; doubles take the portable loops.)
template <typename T>
void PackSigns(BitIsa isa, const T* x, int64_t c, uint64_t* out) {
#if TAPEHOOK_HAVE_AVX2_PATH
  if constexpr (std::is_same_v<T, float>) {
    if (isa == BitIsa::kAvx2) return simd::PackSigns(x, c, out);
  }
#endif
  PackSignsPortable(x, c, out);
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

// counts[i * ldc + j] = sum_k popcount(a[i * depth + k] ^ b[k * n + j]).
// Callers pad m and n to whole kPopRowTile / kPopColTile tiles.
void XorPopcount(bool avx2, int64_t m, int64_t n, int64_t depth,
                 const uint64_t* a, const uint64_t* b, int32_t* counts,
                 int64_t ldc) {
#if TAPEHOOK_HAVE_AVX2_PATH
  if (avx2) {
    return simd::XorPopcount(m, n, depth, a, b, counts, ldc);
  }
#endif
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

#if TAPEHOOK_HAVE_AVX2_PATH
constexpr int64_t kPopRowTile = simd::kPopMR, kPopColTile = simd::kPopNR;
#else
constexpr int64_t kPopRowTile = 1, kPopColTile = 1;
#endif

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
bool Pointwise(const ConvShape& s) {
  return s.k_h == 1 && s.k_w == 1 && s.pad_top == 0 && s.pad_left == 0 &&
         (s.out_h - 1) * s.stride_h < s.in_h &&
         (s.out_w - 1) * s.stride_w < s.in_w;
}

// Packing inside the units keeps a unit's signs in cache and spreads the
// read of x over the threads with the popcounts, instead of a pass of its own
// (which, for a large x, runs at the speed of memory and ends in a barrier).
// A small x is packed up front: that pass is short, and blocks of pixels
// share out better than bands.
BitInput PickBitInput(const ConvShape& s) {
  if (Pointwise(s)) return BitInput::kPixels;
  constexpr int64_t kSmallInput = 1 << 18;  // values of x
  return s.batch * s.in_h * s.in_w * s.in_c < kSmallInput ? BitInput::kPacked
                                                          : BitInput::kBands;
}

// Output rows per band: at least enough that the input rows two bands share
// add at most a quarter to the packing, else as few as give about kBandUnits
// units over the batch.
int64_t BandRows(const ConvShape& s) {
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
                        const ParallelFor& parallel_for) {
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
  std::vector<const int32_t*> pos_bias(s.out_h * s.out_w,
                                       interior_bias.data());
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
          simd::PackSigns512(x + pix0 * C, np, C, sc.rows.data());
        } else {
          for (int64_t p = 0; p < np; ++p) {
            const int64_t in_pix = (q.n * s.in_h + q.oh * s.stride_h) * s.in_w +
                                   q.ow * s.stride_w;
            simd::PackSigns512(x + in_pix * C, 1, C, &sc.rows[p * cw]);
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
    const simd::BitConvBlock<T> block{
        sc.seg.data(), segs,         seg_len,   wb,
        n_pad,         sc.bias.data(), alpha,   y + pix0 * N,
        /*ldy=*/N,     /*n=*/N,      reinterpret_cast<const char*>(next),
        lines};
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
    const int64_t blocks =
        (pixels + kBitPixelBlock512 - 1) / kBitPixelBlock512;
    parallel_for(blocks, kBitPixelBlock512 * pixel_cost,
                 [&](int64_t b0, int64_t b1) {
                   Scratch sc = new_scratch();
                   for (int64_t b = b0; b < b1; ++b) {
                     const int64_t pix0 = b * kBitPixelBlock512;
                     const int64_t np =
                         std::min(kBitPixelBlock512, pixels - pix0);
                     // Stride-1 kPixels: the next block's floats follow.
                     const bool ahead = input == BitInput::kPixels &&
                                        s.out_h == s.in_h &&
                                        s.out_w == s.in_w && b + 1 < b1;
                     const int64_t next_np = std::min(
                         kBitPixelBlock512, pixels - pix0 - np);
                     run_block(sc, pix0, np, whole_input,
                               x + (pix0 + np) * C,
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
                           sc.band.data());
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
        run_block(sc, pix0, std::min(kBitPixelBlock512, end - pix0),
                  band_input,
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

// Signs of W as [row_words][n_pad] words (columns >= N are zeros), each
// tap's popcount (what a zero padding tap adds to a count) and alpha, packed
// on the tier the kernels pick now.
template <typename T>
BitFilter<T> PackBitFilterImpl(const ConvShape& s, const T* w, Scale scale,
                               const ParallelFor& parallel_for) {
  const BitIsa isa = PickBitIsa();
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
        PackWeightSigns(isa, w + (t * C + c) * N, N,
                        static_cast<int>(c % 64),
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
  f.alpha.assign(N, T(1));
  for (int64_t o = 0; o < N && mean_abs; ++o) {
    double sum = 0;
    for (int64_t t = 0; t < taps; ++t) sum += abs_sum[t * N + o];
    f.alpha[o] = static_cast<T>(sum / static_cast<double>(taps * C));
  }
  return f;
}

// The bitpacked forward given its packed filter (packed on f.isa's tier).
template <typename T>
void BitpackedForwardWith(const ConvShape& s, const T* x,
                          const BitFilter<T>& f, T* y,
                          const ParallelFor& parallel_for) {
  const int64_t C = s.in_c, N = s.out_c;
  const int64_t cw = WordsPerPixel(s);
  const int64_t taps = s.k_h * s.k_w;
  const int64_t row_words = taps * cw;
  const int64_t n_pad = f.n_pad;
  const int64_t pixels = OutPixels(s);
  const BitIsa isa = static_cast<BitIsa>(f.isa);
  const uint64_t* const wb = f.words.data();
  const int32_t* const tap_count = f.tap_count.data();
  const T* const alpha_t = f.alpha.data();
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

  // Signs of x, one run of cw words per input pixel.
  const int64_t in_pixels = packed ? s.batch * s.in_h * s.in_w : 0;
  std::unique_ptr<uint64_t[]> xb(new uint64_t[in_pixels * cw]);
  parallel_for(in_pixels, pixel_cost, [&](int64_t p0, int64_t p1) {
#if TAPEHOOK_HAVE_AVX512_PATH
    if constexpr (std::is_same_v<T, float>) {
      if (isa == BitIsa::kAvx512) {
        return simd::PackSigns512(x + p0 * C, p1 - p0, C, &xb[p0 * cw]);
      }
    }
#endif
    for (int64_t p = p0; p < p1; ++p) {
      PackSigns(isa, x + p * C, C, &xb[p * cw]);
    }
  });

#if TAPEHOOK_HAVE_AVX512_PATH
  if (isa == BitIsa::kAvx512) {
    return BitpackedBlocks512(s, input, x, xb.get(), wb, n_pad, tap_count,
                              alpha_t, y, parallel_for);
  }
#endif

  const int64_t blocks = (pixels + kBitPixelBlock - 1) / kBitPixelBlock;
  const int64_t rows_pad = RoundUp(kBitPixelBlock, kPopRowTile);
  parallel_for(blocks, kBitPixelBlock * row_words * N, [&](int64_t b0,
                                                         int64_t b1) {
    std::vector<uint64_t> col(rows_pad * row_words, 0);
    std::vector<int32_t> counts(rows_pad * n_pad);
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
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t pix0 = b * kBitPixelBlock;
      const int64_t np = std::min(kBitPixelBlock, pixels - pix0);
      PixelPos q = Pos(s, pix0);
      for (int64_t p = 0; p < np; ++p) {
        const uint64_t* xn = &xb[q.n * s.in_h * s.in_w * cw];
        uint64_t* row = &col[p * row_words];
        const int64_t ih0 = q.oh * s.stride_h - s.pad_top;
        const int64_t iw0 = q.ow * s.stride_w - s.pad_left;
        border[p] = ih0 < 0 || ih0 + (s.k_h - 1) * s.dil_h >= s.in_h ||
                    iw0 < 0 || iw0 + (s.k_w - 1) * s.dil_w >= s.in_w;
        if (!border[p] && s.dil_w == 1) {
          // Interior: each kernel row is one run of k_w * cw words.
          for (int64_t kh = 0; kh < s.k_h; ++kh) {
            const int64_t ih = ih0 + kh * s.dil_h;
            std::copy_n(xn + (ih * s.in_w + iw0) * cw, s.k_w * cw,
                        row + kh * s.k_w * cw);
          }
        } else {
          for_each_tap(q, [&](int64_t t, int64_t ih, int64_t iw, bool inside) {
            const uint64_t* src = xn + (ih * s.in_w + iw) * cw;
            for (int64_t k = 0; k < cw; ++k) {
              row[t * cw + k] = inside ? src[k] : 0;
            }
          });
        }
        if (++q.ow == s.out_w) {
          q.ow = 0;
          if (++q.oh == s.out_h) q.oh = 0, ++q.n;
        }
      }
      // Rows past np stay as they are: computed, never stored.
      XorPopcount(isa == BitIsa::kAvx2, RoundUp(np, kPopRowTile), n_pad,
                  row_words, col.data(), wb, counts.data(), n_pad);
      // dot = sum over valid taps of (C - 2 * mismatches). A padding tap has
      // zero x bits, so it counted popcount(W tap): take that back out.
      for (int64_t p = 0; p < np; ++p) {
        int32_t* cnt = &counts[p * n_pad];
        int64_t valid = taps;
        if (border[p]) {
          for_each_tap(Pos(s, pix0 + p),
                       [&](int64_t t, int64_t, int64_t, bool inside) {
                         if (inside) return;
                         --valid;
                         const int32_t* tc = &tap_count[t * N];
                         for (int64_t o = 0; o < N; ++o) cnt[o] -= tc[o];
                       });
        }
        // Exact in int32 and in T (|dot| < 2^24 for any real layer).
        const int32_t all_match = static_cast<int32_t>(valid * C);
        T* out = y + (pix0 + p) * N;
        for (int64_t o = 0; o < N; ++o) {
          out[o] = alpha_t[o] * static_cast<T>(all_match - 2 * cnt[o]);
        }
      }
    }
  });
}

}  // namespace

template <typename T>
BitFilter<T> PackBitFilter(const ConvShape& s, const T* w, Scale scale,
                           const ParallelFor& parallel_for) {
  return PackBitFilterImpl(s, w, scale, parallel_for);
}

template <typename T>
bool BitFilterFits(const BitFilter<T>& f, const ConvShape& s, Scale scale) {
  return f.k_h == s.k_h && f.k_w == s.k_w && f.in_c == s.in_c &&
         f.out_c == s.out_c && f.scale == scale &&
         f.isa == static_cast<int>(PickBitIsa());
}

template <typename T>
void BinaryConv2DForwardBinary(const ConvShape& s, const T* x,
                               const BitFilter<T>& f, T* y,
                               const ParallelFor& parallel_for) {
  if (OutPixels(s) == 0) return;
  BitpackedForwardWith(s, x, f, y, parallel_for);
}

template <typename T>
std::vector<float> FilterAlphaFloats(const ConvShape& s, const T* w,
                                     Scale scale) {
  std::vector<float> out;
  if (scale == Scale::kNone) return out;
  for (double a : Alpha(s, w, scale)) out.push_back(static_cast<float>(a));
  return out;
}

template <typename T>
void BinaryConv2DForward(const ConvShape& s, const T* x, const T* w,
                         bool binary_input, Scale scale, T* y,
                         const ParallelFor& parallel_for) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  const int64_t pixels = OutPixels(s);
  if (pixels == 0) return;
  if (binary_input) {
    return BitpackedForwardWith(s, x, PackBitFilter(s, w, scale, parallel_for),
                                y, parallel_for);
  }
  if constexpr (std::is_same<T, float>::value) {
    if (amx::Usable() && amx::SupportsForward(s)) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      if (amx::Forward(s, x, w, AlphaOrNull(alpha), y, parallel_for)) return;
    }
  }
  const PackedB<T> w_hat =
      PackedSignedWeights(s, w, scale, /*transpose=*/false, parallel_for);
  const int64_t blocks = (pixels + kPixelBlock - 1) / kPixelBlock;
  parallel_for(blocks, kPixelBlock * K * N, [&](int64_t b0, int64_t b1) {
    std::vector<T> col(kPixelBlock * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t pix0 = b * kPixelBlock;
      const int64_t np = std::min(kPixelBlock, pixels - pix0);
      Im2Col(s, x, /*binary=*/false, pix0, np, 0, s.k_h * s.k_w, 0, s.in_c,
             col.data());
      Gemm(np, col.data(), K, 1, AllRows(w_hat), y + pix0 * N, N,
           /*accumulate=*/false);
    }
  });
}

template <typename T>
void BinaryConv2DBackpropInput(const ConvShape& s, const T* x, const T* w,
                               const T* dy, Estimator act_est, double clip,
                               Scale scale, T* dx,
                               const ParallelFor& parallel_for) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  const int64_t C = s.in_c;
  const int64_t in_rows = s.batch * s.in_h;
  const int64_t row_len = s.in_w * C;
  if (in_rows * row_len == 0) return;
  if constexpr (std::is_same<T, float>::value) {
    if (OutPixels(s) > 0 && amx::Usable() && amx::SupportsBackpropInput(s)) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      if (amx::BackpropInput(s, x, w, dy, act_est, clip, AlphaOrNull(alpha), dx,
                             parallel_for)) {
        return;
      }
    }
  }

  // The scatter below only adds, and may never touch some pixels.
  parallel_for(in_rows, row_len, [&](int64_t r0, int64_t r1) {
    std::fill(dx + r0 * row_len, dx + r1 * row_len, T(0));
  });

  if (OutPixels(s) > 0) {
    const PackedB<T> w_hat_t =
        PackedSignedWeights(s, w, scale, /*transpose=*/true, parallel_for);
    // A band of `band` output rows scatters into input rows spanning
    // (band - 1) * stride + ek. With band * stride >= ek - stride, bands b
    // and b + 2 never touch the same input row, so all even bands (and then
    // all odd bands) of all images can run concurrently without races.
    const int64_t ek = (s.k_h - 1) * s.dil_h + 1;
    // (ek - 1) / stride == ceil((ek - stride) / stride). Bands are also at
    // least kPixelBlock pixels (or the whole image): the GEMM streams all of
    // W_hat once per call, so it needs enough rows to reuse it.
    const int64_t band = std::min(
        s.out_h, std::max({int64_t{1}, (ek - 1) / s.stride_h,
                           (kPixelBlock + s.out_w - 1) / s.out_w}));
    const int64_t bands = (s.out_h + band - 1) / band;
    const int64_t hw = s.out_h * s.out_w;
    for (int64_t parity = 0; parity < 2; ++parity) {
      const int64_t per_image = (bands - parity + 1) / 2;
      if (per_image == 0) continue;
      const int64_t cost = band * s.out_w * K * N;
      parallel_for(s.batch * per_image, cost, [&](int64_t u0, int64_t u1) {
        std::vector<T> dcol(2 * kPixelBlock * K);
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t n = u / per_image;
          const int64_t oh0 = (parity + 2 * (u % per_image)) * band;
          const int64_t oh1 = std::min(s.out_h, oh0 + band);
          const int64_t begin = n * hw + oh0 * s.out_w;
          const int64_t end = n * hw + oh1 * s.out_w;
          // Equal blocks of kPixelBlock to 2 * kPixelBlock - 1 pixels (or
          // the whole band): no small leftover block.
          const int64_t blocks =
              std::max<int64_t>(1, (end - begin) / kPixelBlock);
          for (int64_t b = 0; b < blocks; ++b) {
            const int64_t pix0 = begin + (end - begin) * b / blocks;
            const int64_t np = begin + (end - begin) * (b + 1) / blocks - pix0;
            Gemm(np, dy + pix0 * N, N, 1, AllRows(w_hat_t), dcol.data(), K,
                 /*accumulate=*/false);
            Col2ImAdd(s, dcol.data(), pix0, np, dx);
          }
        }
      });
    }
  }

  if (act_est != Estimator::kNone) {
    parallel_for(in_rows, row_len * 8, [&](int64_t r0, int64_t r1) {
      const T* xs = x;  // locals: no reloads through the lambda's captures
      T* g = dx;
      const int64_t end = r1 * row_len;
      if (act_est == Estimator::kSteSign) {  // the common case, vectorized
        const T c = static_cast<T>(clip);
        for (int64_t i = r0 * row_len; i < end; ++i) {
          g[i] *= std::abs(xs[i]) <= c ? T(1) : T(0);
        }
        return;
      }
      for (int64_t i = r0 * row_len; i < end; ++i) {
        g[i] *= static_cast<T>(EstimatorGrad(act_est, xs[i], clip));
      }
    });
  }
}

template <typename T>
void BinaryConv2DBackpropFilter(const ConvShape& s, const T* x, const T* w,
                                const T* dy, Estimator act_est,
                                Estimator w_est, double clip, Scale scale,
                                T* dw, const ParallelFor& parallel_for) {
  const int64_t C = s.in_c;
  const int64_t N = s.out_c;
  if (FilterSize(s) * N == 0) return;
  const int64_t pixels = OutPixels(s);
  if constexpr (std::is_same<T, float>::value) {
    if (pixels > 0 && amx::Usable() && amx::SupportsBackpropFilter(s)) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      if (amx::BackpropFilter(s, x, w, dy, act_est, w_est, clip,
                              AlphaOrNull(alpha), dw, parallel_for)) {
        return;
      }
    }
  }
  const bool binary = act_est != Estimator::kNone;
  const std::vector<double> alpha = Alpha(s, w, scale);

  // A work unit owns the dW rows of one tap and one block of input channels
  // and sums over all pixels in order: no partial sums to reduce, and the
  // result does not depend on how parallel_for shards the units.
  const int64_t taps = s.k_h * s.k_w;
  const int64_t cblocks = (C + kFilterChannelBlock - 1) / kFilterChannelBlock;
  const int64_t cost = 2 * std::max<int64_t>(pixels, 1) *
                       std::min(C, kFilterChannelBlock) * N;
  PackedB<T> dy_packed;
  PackB(pixels, N, dy, N, 1, parallel_for, &dy_packed);
  // Each input value is read once per tap: take its sign once, up front.
  std::vector<T> x_signs;
  if (binary) {
    const int64_t rows = s.batch * s.in_h, row_len = s.in_w * C;
    x_signs.resize(rows * row_len);
    parallel_for(rows, row_len, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * row_len; i < r1 * row_len; ++i) {
        x_signs[i] = Sign(x[i]);
      }
    });
  }
  const T* x_hat = binary ? x_signs.data() : x;
  parallel_for(taps * cblocks, cost, [&](int64_t u0, int64_t u1) {
    std::vector<T> col(kFilterPixelBlock * kFilterChannelBlock);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t tap = u / cblocks;
      const int64_t c0 = u % cblocks * kFilterChannelBlock;
      const int64_t c1 = std::min(C, c0 + kFilterChannelBlock);
      const int64_t rows = c1 - c0;
      T* out = dw + (tap * C + c0) * N;
      std::fill(out, out + rows * N, T(0));
      for (int64_t pix0 = 0; pix0 < pixels; pix0 += kFilterPixelBlock) {
        const int64_t np = std::min(kFilterPixelBlock, pixels - pix0);
        Im2Col(s, x_hat, /*binary=*/false, pix0, np, tap, tap + 1, c0, c1,
               col.data());
        // out[rows, N] += col^T[rows, np] * dy[np, N].
        Gemm(rows, col.data(), 1, rows, PackedRows<T>{&dy_packed, pix0, np},
             out, N, /*accumulate=*/true);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const T* wk = w + (tap * C + c0 + r) * N;
        for (int64_t o = 0; o < N; ++o) {
          out[r * N + o] *=
              static_cast<T>(alpha[o] * EstimatorGrad(w_est, wk[o], clip));
        }
      }
    }
  });
}

#define TAPEHOOK_INSTANTIATE(T)                                              \
  template BitFilter<T> PackBitFilter<T>(const ConvShape&, const T*, Scale,  \
                                         const ParallelFor&);                \
  template bool BitFilterFits<T>(const BitFilter<T>&, const ConvShape&,      \
                                 Scale);                                     \
  template void BinaryConv2DForwardBinary<T>(                                \
      const ConvShape&, const T*, const BitFilter<T>&, T*,                   \
      const ParallelFor&);                                                   \
  template std::vector<float> FilterAlphaFloats<T>(const ConvShape&,       \
                                                   const T*, Scale);         \
  template void BinaryConv2DForward<T>(const ConvShape&, const T*, const T*, \
                                       bool, Scale, T*, const ParallelFor&); \
  template void BinaryConv2DBackpropInput<T>(                                \
      const ConvShape&, const T*, const T*, const T*, Estimator, double,     \
      Scale, T*, const ParallelFor&);                                        \
  template void BinaryConv2DBackpropFilter<T>(                               \
      const ConvShape&, const T*, const T*, const T*, Estimator, Estimator,  \
      double, Scale, T*, const ParallelFor&);

TAPEHOOK_INSTANTIATE(float)
TAPEHOOK_INSTANTIATE(double)
#undef TAPEHOOK_INSTANTIATE

}  // namespace tapehook
