// Binary Conv2D kernels: im2col / col2im around one small register-blocked
// GEMM. Plain portable C++17; the inner loops are written so that -O3
// vectorizes them without any -march flags.
#include "binary_conv.h"

#include <algorithm>
#include <cmath>
#include <memory>
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

// Output pixels per im2col block: a [P, K] block stays in L1/L2.
constexpr int64_t kPixelBlock = 32;
// BackpropFilter's GEMM has depth = pixels; longer blocks amortize the loads
// and stores of its [K, out_c] accumulator.
constexpr int64_t kFilterPixelBlock = 128;
// Depth of one GEMM pass, so the panels of A and B a tile reads stay in L1.
constexpr int64_t kDepthBlock = 128;
// BackpropFilter keeps one [K, out_c] partial sum per chunk of pixels, and
// splits chunks further by kernel taps until there are enough work units
// to keep a large thread pool busy.
constexpr int64_t kMaxFilterPartials = 64;
constexpr int64_t kFilterPartialBytes = int64_t{128} << 20;
constexpr int64_t kFilterUnits = 64;

template <typename T>
inline T Sign(T t) {
  return t >= T(0) ? T(1) : T(-1);
}

// Register tile of the GEMM: kMR rows by kNR columns of C, kNR being two
// 128-bit vectors (SSE2 is all that the portable build may assume).
template <typename T>
struct GemmTile {
  static constexpr int kMR = 4;
  static constexpr int kNR = 32 / sizeof(T);
};

// c[i, j] (+)= sum_k a[k][i] * b[k, j] for one tile, a being a packed
// [depth][kMR] panel. With kFullN the tile is kNR wide, its loops unroll
// fully and acc lives in registers. Rows >= mr of the panel are zeros and are
// computed but not stored.
template <typename T, bool kFullN>
inline void GemmTileKernel(int64_t depth, const T* a, const T* b, int64_t ldb,
                           T* c, int64_t ldc, bool accumulate, int mr,
                           int nr) {
  constexpr int MR = GemmTile<T>::kMR;
  constexpr int NR = GemmTile<T>::kNR;
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

// C[m, n] (+)= A[m, depth] * B[depth, n]. B and C are row-major; A is read
// through strides so col*W, dY*W^T and col^T*dY all use this one routine.
// A is packed into [depth][kMR] panels first: the tile kernel then reads it
// contiguously, and the compiler vectorizes across columns, not depth.
template <typename T>
void Gemm(int64_t m, int64_t n, int64_t depth, const T* a, int64_t a_rs,
          int64_t a_cs, const T* b, int64_t ldb, T* c, int64_t ldc,
          bool accumulate) {
  constexpr int MR = GemmTile<T>::kMR;
  constexpr int NR = GemmTile<T>::kNR;
  T panel[kDepthBlock * MR];
  for (int64_t k0 = 0; k0 < depth; k0 += kDepthBlock) {
    const int64_t kc = std::min(kDepthBlock, depth - k0);
    const bool acc = accumulate || k0 > 0;
    const T* bk = b + k0 * ldb;
    for (int64_t i0 = 0; i0 < m; i0 += MR) {
      const int mr = static_cast<int>(std::min<int64_t>(MR, m - i0));
      const T* at = a + i0 * a_rs + k0 * a_cs;
      for (int64_t k = 0; k < kc; ++k) {
        for (int i = 0; i < MR; ++i) {
          panel[k * MR + i] = i < mr ? at[i * a_rs + k * a_cs] : T(0);
        }
      }
      for (int64_t j0 = 0; j0 < n; j0 += NR) {
        const int nr = static_cast<int>(std::min<int64_t>(NR, n - j0));
        T* ct = c + i0 * ldc + j0;
        if (nr == NR) {
          GemmTileKernel<T, true>(kc, panel, bk + j0, ldb, ct, ldc, acc, mr,
                                  NR);
        } else {
          GemmTileKernel<T, false>(kc, panel, bk + j0, ldb, ct, ldc, acc, mr,
                                   nr);
        }
      }
    }
  }
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

// W_hat as a [K, out_c] matrix (HWIO flattened), or its transpose.
template <typename T>
std::vector<T> SignedWeights(const ConvShape& s, const T* w,
                             const std::vector<double>& alpha,
                             bool transpose) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  std::vector<T> out(K * N);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t o = 0; o < N; ++o) {
      const T v = static_cast<T>(alpha[o]) * Sign(w[k * N + o]);
      out[transpose ? o * K + k : k * N + o] = v;
    }
  }
  return out;
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

// Row p of col [np, (tap1 - tap0) * in_c] holds kernel taps [tap0, tap1)
// (tap = kh * k_w + kw) of the receptive field of output pixel pix0 + p,
// laid out like the K axis of an HWIO filter. Taps in the padding are 0
// (not sign(0)); x_hat = sign(x) when binary.
template <typename T>
void Im2Col(const ConvShape& s, const T* x, bool binary, int64_t pix0,
            int64_t np, int64_t tap0, int64_t tap1, T* col) {
  const int64_t C = s.in_c;
  for (int64_t p = 0; p < np; ++p) {
    const PixelPos q = Pos(s, pix0 + p);
    const T* xn = x + q.n * s.in_h * s.in_w * C;
    T* dst = col + p * (tap1 - tap0) * C;
    for (int64_t tap = tap0; tap < tap1; ++tap, dst += C) {
      const int64_t ih = q.oh * s.stride_h - s.pad_top + tap / s.k_w * s.dil_h;
      const int64_t iw =
          q.ow * s.stride_w - s.pad_left + tap % s.k_w * s.dil_w;
      if (ih < 0 || ih >= s.in_h || iw < 0 || iw >= s.in_w) {
        std::fill(dst, dst + C, T(0));
        continue;
      }
      const T* src = xn + (ih * s.in_w + iw) * C;
      if (binary) {
        for (int64_t c = 0; c < C; ++c) dst[c] = Sign(src[c]);
      } else {
        std::copy(src, src + C, dst);
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

}  // namespace

template <typename T>
void BinaryConv2DForward(const ConvShape& s, const T* x, const T* w,
                         bool binary_input, Scale scale, T* y,
                         const ParallelFor& parallel_for) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  const int64_t pixels = OutPixels(s);
  if (pixels == 0) return;
  const std::vector<T> w_hat =
      SignedWeights(s, w, Alpha(s, w, scale), /*transpose=*/false);
  const int64_t blocks = (pixels + kPixelBlock - 1) / kPixelBlock;
  parallel_for(blocks, kPixelBlock * K * N, [&](int64_t b0, int64_t b1) {
    std::vector<T> col(kPixelBlock * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t pix0 = b * kPixelBlock;
      const int64_t np = std::min(kPixelBlock, pixels - pix0);
      Im2Col(s, x, binary_input, pix0, np, 0, s.k_h * s.k_w, col.data());
      Gemm(np, N, K, col.data(), K, 1, w_hat.data(), N, y + pix0 * N, N,
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

  // The scatter below only adds, and may never touch some pixels.
  parallel_for(in_rows, row_len, [&](int64_t r0, int64_t r1) {
    std::fill(dx + r0 * row_len, dx + r1 * row_len, T(0));
  });

  if (OutPixels(s) > 0) {
    const std::vector<T> w_hat_t =
        SignedWeights(s, w, Alpha(s, w, scale), /*transpose=*/true);
    // A band of `band` output rows scatters into input rows spanning
    // (band - 1) * stride + ek. With band * stride >= ek - stride, bands b
    // and b + 2 never touch the same input row, so all even bands (and then
    // all odd bands) of all images can run concurrently without races.
    const int64_t ek = (s.k_h - 1) * s.dil_h + 1;
    // (ek - 1) / stride == ceil((ek - stride) / stride).
    const int64_t band = std::max<int64_t>(1, (ek - 1) / s.stride_h);
    const int64_t bands = (s.out_h + band - 1) / band;
    const int64_t hw = s.out_h * s.out_w;
    for (int64_t parity = 0; parity < 2; ++parity) {
      const int64_t per_image = (bands - parity + 1) / 2;
      if (per_image == 0) continue;
      const int64_t cost = band * s.out_w * K * N;
      parallel_for(s.batch * per_image, cost, [&](int64_t u0, int64_t u1) {
        std::vector<T> dcol(kPixelBlock * K);
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t n = u / per_image;
          const int64_t oh0 = (parity + 2 * (u % per_image)) * band;
          const int64_t oh1 = std::min(s.out_h, oh0 + band);
          const int64_t end = n * hw + oh1 * s.out_w;
          for (int64_t pix0 = n * hw + oh0 * s.out_w; pix0 < end;
               pix0 += kPixelBlock) {
            const int64_t np = std::min(kPixelBlock, end - pix0);
            Gemm(np, K, N, dy + pix0 * N, N, 1, w_hat_t.data(), K,
                 dcol.data(), K, /*accumulate=*/false);
            Col2ImAdd(s, dcol.data(), pix0, np, dx);
          }
        }
      });
    }
  }

  if (act_est != Estimator::kNone) {
    parallel_for(in_rows, row_len * 8, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * row_len; i < r1 * row_len; ++i) {
        dx[i] *= static_cast<T>(EstimatorGrad(act_est, x[i], clip));
      }
    });
  }
}

template <typename T>
void BinaryConv2DBackpropFilter(const ConvShape& s, const T* x, const T* w,
                                const T* dy, Estimator act_est,
                                Estimator w_est, double clip, Scale scale,
                                T* dw, const ParallelFor& parallel_for) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  const int64_t KN = K * N;
  if (KN == 0) return;
  const int64_t pixels = OutPixels(s);
  const bool binary = act_est != Estimator::kNone;

  // The pixels are split into a fixed number of chunks, each with its own
  // partial sum, reduced below in chunk order: the result does not depend on
  // how parallel_for shards or schedules the work. A unit of work is one
  // chunk times one group of kernel taps (a range of the partial's rows).
  const int64_t by_memory = std::max<int64_t>(
      1, kFilterPartialBytes / (KN * static_cast<int64_t>(sizeof(T))));
  const int64_t chunks =
      std::min({(pixels + kFilterPixelBlock - 1) / kFilterPixelBlock,
                kMaxFilterPartials, by_memory});
  const int64_t taps = s.k_h * s.k_w;
  const int64_t groups =
      chunks > 0 ? std::min(taps, (kFilterUnits + chunks - 1) / chunks) : 0;
  std::unique_ptr<T[]> partials(new T[chunks * KN]);
  if (chunks > 0) {
    const int64_t cost = (pixels + chunks - 1) / chunks * KN / groups;
    parallel_for(chunks * groups, cost, [&](int64_t u0, int64_t u1) {
      std::vector<T> col(kFilterPixelBlock * K);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t c = u / groups, g = u % groups;
        const int64_t tap0 = g * taps / groups, tap1 = (g + 1) * taps / groups;
        const int64_t rows = (tap1 - tap0) * s.in_c;
        T* acc = partials.get() + c * KN + tap0 * s.in_c * N;
        std::fill(acc, acc + rows * N, T(0));
        const int64_t end = (c + 1) * pixels / chunks;
        for (int64_t pix0 = c * pixels / chunks; pix0 < end;
             pix0 += kFilterPixelBlock) {
          const int64_t np = std::min(kFilterPixelBlock, end - pix0);
          Im2Col(s, x, binary, pix0, np, tap0, tap1, col.data());
          // acc[rows, N] += col^T[rows, np] * dy[np, N].
          Gemm(rows, N, np, col.data(), 1, rows, dy + pix0 * N, N, acc, N,
               /*accumulate=*/true);
        }
      }
    });
  }

  const std::vector<double> alpha = Alpha(s, w, scale);
  parallel_for(K, N * (chunks + 8), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      T* out = dw + k * N;
      std::fill(out, out + N, T(0));
      for (int64_t c = 0; c < chunks; ++c) {
        const T* part = partials.get() + c * KN + k * N;
        for (int64_t o = 0; o < N; ++o) out[o] += part[o];
      }
      for (int64_t o = 0; o < N; ++o) {
        out[o] *= static_cast<T>(alpha[o] *
                                 EstimatorGrad(w_est, w[k * N + o], clip));
      }
    }
  });
}

#define TAPEHOOK_INSTANTIATE(T)                                              \
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
