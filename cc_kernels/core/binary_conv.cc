// Entry points of the binary conv kernels (binary_conv.h): each runs its
// plan's implementation (plan.h), the bitpacked forward (bitpacked.h), the
// AMX kernels (amx_conv.h), the sign-table backprops (lut_backprop.h) or the
// im2col GEMM (float_gemm.h).
#include "binary_conv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "amx_conv.h"
#include "bitpacked.h"
#include "conv_util.h"
#include "float_gemm.h"
#include "lut_backprop.h"
#include "lut_backprop_avx2.h"
#include "plan.h"

namespace tapehook {

namespace {

// The implementation the entry points run (plan.h: RunnableOrBest).
template <typename T>
Impl PlanOf(ConvOp op, const ConvShape& s, bool binary_input, bool packed,
            Impl impl) {
  return RunnableOrBest(
      QueryOf(op, s, binary_input, packed, std::is_same_v<T, double>), impl);
}

// dx *= e'(x), the activation estimator's mask (nothing for kNone): after
// the sums of every plan that does not apply it itself.
template <typename T>
void ApplyInputEstimator(const ConvShape& s, const T* x, Estimator act_est,
                         double clip, T* dx, const ParallelFor& parallel_for) {
  if (act_est == Estimator::kNone) return;
  const int64_t in_rows = s.batch * s.in_h;
  const int64_t row_len = s.in_w * s.in_c;
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
    if (act_est == Estimator::kApproxSign) {  // Bi-Real-Net's, vectorized
      for (int64_t i = r0 * row_len; i < end; ++i)
        g[i] *= ApproxSignGrad(xs[i]);
      return;
    }
    for (int64_t i = r0 * row_len; i < end; ++i) {
      g[i] *= static_cast<T>(EstimatorGrad(act_est, xs[i], clip));
    }
  });
}

// dw[r, o] *= alpha[o] * e'(w[r, o]) for the dW rows [row0, row1) (row =
// tap * in_c + input channel): after the sums of every plan that does not
// apply it itself.
template <typename T>
void ScaleFilterGradientRows(const T* w, const std::vector<double>& alpha,
                             Estimator w_est, double clip, int64_t row0,
                             int64_t row1, int64_t out_c, T* dw) {
  if (w_est == Estimator::kSteSign) {  // the common case, vectorized
    // |t| <= clip as EstimatorGrad compares it (in double) is |t| <= c for
    // the largest T c not above clip.
    T c = static_cast<T>(clip);
    if (static_cast<double>(c) > clip) c = std::nextafter(c, T(0));
    // Two loops that vectorize, (g * alpha) * mask: the same bits as
    // g * (alpha * mask) for alpha >= 0.
    const std::vector<T> a(alpha.begin(), alpha.end());
    for (int64_t r = row0; r < row1; ++r) {
      T* out = dw + r * out_c;
      for (int64_t o = 0; o < out_c; ++o) out[o] *= a[o];
    }
    for (int64_t i = row0 * out_c; i < row1 * out_c; ++i) {
      dw[i] *= std::abs(w[i]) <= c ? T(1) : T(0);
    }
    return;
  }
  for (int64_t r = row0; r < row1; ++r) {
    const T* wk = w + r * out_c;
    T* out = dw + r * out_c;
    for (int64_t o = 0; o < out_c; ++o) {
      out[o] *= static_cast<T>(alpha[o] * EstimatorGrad(w_est, wk[o], clip));
    }
  }
}

// Where input position i (a row or a column) receives from through kernel
// tap t of that axis: src[i * k + t] is the output position that reads i
// through t, or -1 (padding, or between strides).
std::vector<int64_t> TapSources(int64_t in, int64_t k, int64_t dil,
                                int64_t stride, int64_t pad, int64_t out) {
  std::vector<int64_t> src(in * k, -1);
  for (int64_t i = 0; i < in; ++i) {
    for (int64_t t = 0; t < k; ++t) {
      const int64_t num = i + pad - t * dil;
      if (num >= 0 && num % stride == 0 && num / stride < out) {
        src[i * k + t] = num / stride;
      }
    }
  }
  return src;
}

// The positions 0..in-1 of an axis grouped by the set of taps they receive
// from (for a 3x3 SAME conv: the first, the interior, the last), each group
// in ascending order.
std::vector<std::vector<int64_t>> TapClasses(const std::vector<int64_t>& src,
                                             int64_t in, int64_t k) {
  std::vector<std::vector<int64_t>> groups;
  std::vector<std::vector<bool>> keys;
  for (int64_t i = 0; i < in; ++i) {
    std::vector<bool> key(k);
    for (int64_t t = 0; t < k; ++t) key[t] = src[i * k + t] >= 0;
    const auto it = std::find(keys.begin(), keys.end(), key);
    if (it == keys.end()) {
      keys.push_back(key);
      groups.push_back({i});
    } else {
      groups[it - keys.begin()].push_back(i);
    }
  }
  return groups;
}

// dX as the transposed conv, by taps: one GEMM per block of input pixels,
// row i being input pixel q_i, depth (tap, output channel) over the taps
// that any of the block's pixels receives from (row i of a tap's A is the
// dY pixel that reads q_i through it, or zeros), B = alpha * sign(W) by
// tap ([taps * N, C]). Pixels are ordered by the set of taps they receive
// from (rows' class, then columns'), so a block seldom computes a padding
// tap's products (a 4x4 image has 31 % of them), and each pixel's sums are
// stored once: no [pixels, 9 C] block scattered back, and blocks own
// disjoint pixels, so they run in any order without races. Every pixel is
// written, with zeros where no tap reaches it.
template <typename T>
void BackpropInputByTaps(const ConvShape& s, const T* dy,
                         const PackedB<T>& w_taps, T* dx,
                         const ParallelFor& parallel_for) {
  const int64_t N = s.out_c, C = s.in_c, taps = s.k_h * s.k_w;
  const std::vector<int64_t> h_src =
      TapSources(s.in_h, s.k_h, s.dil_h, s.stride_h, s.pad_top, s.out_h);
  const std::vector<int64_t> w_src =
      TapSources(s.in_w, s.k_w, s.dil_w, s.stride_w, s.pad_left, s.out_w);
  struct Pixel {
    int64_t n, ih, iw;
  };
  std::vector<Pixel> order;  // input pixels, by class
  order.reserve(s.batch * s.in_h * s.in_w);
  const auto w_classes = TapClasses(w_src, s.in_w, s.k_w);
  for (const auto& rows : TapClasses(h_src, s.in_h, s.k_h)) {
    for (const auto& cols : w_classes) {
      for (int64_t n = 0; n < s.batch; ++n) {
        for (int64_t ih : rows) {
          for (int64_t iw : cols) order.push_back({n, ih, iw});
        }
      }
    }
  }
  constexpr int64_t kRows = kPixelBlock;
  const int64_t total = static_cast<int64_t>(order.size());
  const int64_t blocks = (total + kRows - 1) / kRows;
  // Blocks of one class cost alike, of different classes not (a stride-2
  // conv's pixels receive from 1, 2 or 4 taps): work unit u runs block
  // u * step mod blocks, step coprime to blocks and near 0.618 blocks, so
  // any run of units mixes the classes and the shards balance.
  int64_t step = std::max<int64_t>(1, blocks * 618 / 1000);
  while (std::gcd(step, blocks) != 1) ++step;
  parallel_for(blocks, kRows * taps * N * C, [&](int64_t u0, int64_t u1) {
    std::vector<T> sums(kRows * C);
    std::vector<const T*> rows(taps * kRows);
    std::vector<PackedRows<T>> segments;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u * step % blocks;
      const int64_t p0 = b * kRows, m = std::min(kRows, total - p0);
      segments.clear();
      for (int64_t t = 0; t < taps; ++t) {
        const int64_t kh = t / s.k_w, kw = t % s.k_w;
        const T** seg = rows.data() + segments.size() * m;
        bool any = false;
        for (int64_t i = 0; i < m; ++i) {
          const Pixel& q = order[p0 + i];
          const int64_t oh = h_src[q.ih * s.k_h + kh];
          const int64_t ow = w_src[q.iw * s.k_w + kw];
          seg[i] = oh >= 0 && ow >= 0
                       ? dy + ((q.n * s.out_h + oh) * s.out_w + ow) * N
                       : nullptr;
          any = any || seg[i] != nullptr;
        }
        if (any) segments.push_back(PackedRows<T>{&w_taps, t * N, N});
      }
      if (segments.empty()) {
        std::fill(sums.begin(), sums.begin() + m * C, T(0));
      } else {
        GemmSegments(m, static_cast<int64_t>(segments.size()), segments.data(),
                     GatheredA<T>{rows.data(), m}, sums.data(), C,
                     /*accumulate=*/false);
      }
      for (int64_t i = 0; i < m; ++i) {
        const Pixel& q = order[p0 + i];
        std::copy_n(sums.data() + i * C, C,
                    dx + ((q.n * s.in_h + q.ih) * s.in_w + q.iw) * C);
      }
    }
  });
}

}  // namespace

bool ParseBalance(const std::string& name, Balance* out) {
  if (name == "none") return *out = Balance::kNone, true;
  if (name == "mean") return *out = Balance::kMean, true;
  if (name == "std") return *out = Balance::kStd, true;
  return false;
}

template <typename T>
std::vector<T> BalancedFilter(const ConvShape& s, const T* w, Balance balance) {
  const int64_t K = FilterSize(s), N = s.out_c;
  std::vector<T> out(K * N);
  std::vector<double> mean(N, 0.0), var(N, 0.0);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t o = 0; o < N; ++o) mean[o] += w[k * N + o];
  }
  std::vector<T> mean_t(N);
  for (int64_t o = 0; o < N; ++o) mean_t[o] = static_cast<T>(mean[o] / K);
  // As TF: the centred value is W - mean in T, the variance that of those.
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t o = 0; o < N; ++o) {
      const T c = w[k * N + o] - mean_t[o];
      out[k * N + o] = c;
      var[o] += static_cast<double>(c) * c;
    }
  }
  if (balance == Balance::kStd) {
    std::vector<T> inv(N);
    for (int64_t o = 0; o < N; ++o) {
      inv[o] = static_cast<T>(1.0 / std::sqrt(var[o] / K + 1e-12));
    }
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t o = 0; o < N; ++o) out[k * N + o] *= inv[o];
    }
  }
  return out;
}

template <typename T>
BitFilter<T> PackBitFilter(const ConvShape& s, const T* w, Scale scale,
                           const ParallelFor& parallel_for, Impl impl) {
  return PackBitFilterImpl(s, w, scale,
                           PlanOf<T>(ConvOp::kForward, s, true, false, impl),
                           parallel_for);
}

template <typename T>
bool BitFilterFits(const BitFilter<T>& f, const ConvShape& s, Scale scale,
                   Impl impl) {
  return f.k_h == s.k_h && f.k_w == s.k_w && f.in_c == s.in_c &&
         f.out_c == s.out_c && f.scale == scale &&
         f.isa == static_cast<int>(BitIsaOf(
                      PlanOf<T>(ConvOp::kForward, s, true, false, impl)));
}

template <typename T>
void BinaryConv2DForwardBinary(const ConvShape& s, const T* x,
                               const BitFilter<T>& f, T* y,
                               const ParallelFor& parallel_for,
                               const OutputAffine<T>* affine,
                               const T* threshold) {
  if (OutPixels(s) == 0) return;
  BitpackedForwardWith(s, x, f, y, parallel_for, affine, threshold);
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
                         const ParallelFor& parallel_for, Impl impl,
                         const T* threshold) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  const int64_t pixels = OutPixels(s);
  if (pixels == 0) return;
  if (binary_input) {
    return BitpackedForwardWith(
        s, x, PackBitFilter(s, w, scale, parallel_for, impl), y, parallel_for,
        static_cast<const OutputAffine<T>*>(nullptr), threshold);
  }
  impl = PlanOf<T>(ConvOp::kForward, s, false, false, impl);
  if constexpr (std::is_same<T, float>::value) {
    if (impl == Impl::kAmx) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      if (amx::Forward(s, x, w, AlphaOrNull(alpha), y, parallel_for)) return;
    }
  }
  const PackedB<T> w_hat = PackedSignedWeights(
      s, w, scale, WeightLayout::kFilter, impl, parallel_for);
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
                               const ParallelFor& parallel_for, Impl impl,
                               DySplit dy_split) {
  const int64_t in_rows = s.batch * s.in_h;
  const int64_t row_len = s.in_w * s.in_c;
  if (in_rows * row_len == 0) return;
  impl = PlanOf<T>(ConvOp::kBackpropInput, s, act_est != Estimator::kNone,
                   false, impl);
  if constexpr (std::is_same<T, float>::value) {
    if (OutPixels(s) > 0 && impl == Impl::kAmx) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      if (amx::BackpropInput(s, x, w, dy, act_est, clip, AlphaOrNull(alpha), dx,
                             parallel_for, dy_split)) {
        return;
      }
    }
  }

  bool summed = false;  // dx holds the sums, before the activation mask
  if constexpr (std::is_same<T, float>::value) {
    if (OutPixels(s) > 0 && impl == Impl::kAvx512) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      summed =
          lut::BackpropInput(s, w, AlphaOrNull(alpha), dy, dx, parallel_for);
    }
  }

  if (!summed) {
    if (OutPixels(s) > 0) {
      BackpropInputByTaps(s, dy,
                          PackedSignedWeights(s, w, scale, WeightLayout::kByTap,
                                              impl, parallel_for),
                          dx, parallel_for);
    } else {
      std::fill(dx, dx + in_rows * row_len, T(0));
    }
  }

  ApplyInputEstimator(s, x, act_est, clip, dx, parallel_for);
}

template <typename T>
void BinaryConv2DBackpropFilter(const ConvShape& s, const T* x, const T* w,
                                const T* dy, Estimator act_est, Estimator w_est,
                                double clip, Scale scale, T* dw,
                                const ParallelFor& parallel_for, Impl impl,
                                DySplit dy_split) {
  const int64_t C = s.in_c;
  const int64_t N = s.out_c;
  if (FilterSize(s) * N == 0) return;
  const int64_t pixels = OutPixels(s);
  impl = PlanOf<T>(ConvOp::kBackpropFilter, s, act_est != Estimator::kNone,
                   false, impl);
  if constexpr (std::is_same<T, float>::value) {
    if (pixels > 0 && impl == Impl::kAmx) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      if (amx::BackpropFilter(s, x, w, dy, act_est, w_est, clip,
                              AlphaOrNull(alpha), dw, parallel_for, dy_split)) {
        return;
      }
    }
  }
  const bool binary = act_est != Estimator::kNone;
  if constexpr (std::is_same<T, float>::value) {
    if (pixels > 0 && binary &&
        ((impl == Impl::kAvx512 &&
          lut::BackpropFilter(s, x, dy, dw, parallel_for)) ||
         (impl == Impl::kAvx2 &&
          lut_avx2::BackpropFilter(s, x, dy, dw, parallel_for)))) {
      ScaleFilterGradient(s, w, w_est, clip, scale, dw, parallel_for);
      return;
    }
  }
  const std::vector<double> alpha = Alpha(s, w, scale);

  // A work unit owns the dW rows of one tap and one block of input channels
  // and sums over all pixels in order: no partial sums to reduce, and the
  // result does not depend on how parallel_for shards the units.
  const int64_t taps = s.k_h * s.k_w;
  const int64_t cblocks = (C + kFilterChannelBlock - 1) / kFilterChannelBlock;
  const int64_t cost =
      2 * std::max<int64_t>(pixels, 1) * std::min(C, kFilterChannelBlock) * N;
  PackedB<T> dy_packed;
  PackB(pixels, N, dy, N, 1, impl, parallel_for, &dy_packed);
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
      ScaleFilterGradientRows(w, alpha, w_est, clip, tap * C + c0, tap * C + c1,
                              N, dw);
    }
  });
}

template <typename T>
void ScaleFilterGradient(const ConvShape& s, const T* w, Estimator w_est,
                         double clip, Scale scale, T* dw,
                         const ParallelFor& parallel_for) {
  const std::vector<double> alpha = Alpha(s, w, scale);
  parallel_for(FilterSize(s), 4 * s.out_c, [&](int64_t r0, int64_t r1) {
    ScaleFilterGradientRows(w, alpha, w_est, clip, r0, r1, s.out_c, dw);
  });
}

#define TAPEHOOK_INSTANTIATE(T)                                                \
  template std::vector<T> BalancedFilter<T>(const ConvShape&, const T*,        \
                                            Balance);                          \
  template BitFilter<T> PackBitFilter<T>(const ConvShape&, const T*, Scale,    \
                                         const ParallelFor&, Impl);            \
  template bool BitFilterFits<T>(const BitFilter<T>&, const ConvShape&, Scale, \
                                 Impl);                                        \
  template void BinaryConv2DForwardBinary<T>(                                  \
      const ConvShape&, const T*, const BitFilter<T>&, T*, const ParallelFor&, \
      const OutputAffine<T>*, const T*);                                       \
  template std::vector<float> FilterAlphaFloats<T>(const ConvShape&, const T*, \
                                                   Scale);                     \
  template void BinaryConv2DForward<T>(const ConvShape&, const T*, const T*,   \
                                       bool, Scale, T*, const ParallelFor&,    \
                                       Impl, const T*);                        \
  template void BinaryConv2DBackpropInput<T>(                                  \
      const ConvShape&, const T*, const T*, const T*, Estimator, double,       \
      Scale, T*, const ParallelFor&, Impl, DySplit);                           \
  template void BinaryConv2DBackpropFilter<T>(                                 \
      const ConvShape&, const T*, const T*, const T*, Estimator, Estimator,    \
      double, Scale, T*, const ParallelFor&, Impl, DySplit);                   \
  template void ScaleFilterGradient<T>(const ConvShape&, const T*, Estimator,  \
                                       double, Scale, T*, const ParallelFor&);

TAPEHOOK_INSTANTIATE(float)
TAPEHOOK_INSTANTIATE(double)
#undef TAPEHOOK_INSTANTIATE

}  // namespace tapehook
