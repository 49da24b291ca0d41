// Entry points of the binary conv kernels (binary_conv.h): each runs its
// plan's implementation (plan.h), the bitpacked forward (bitpacked.h), the
// AMX kernels (amx_conv.h), the sign-table backprops (lut_backprop.h) or the
// im2col GEMM (float_gemm.h).
#include "binary_conv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

}  // namespace

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
                               const OutputAffine<T>* affine) {
  if (OutPixels(s) == 0) return;
  BitpackedForwardWith(s, x, f, y, parallel_for, affine);
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
                         const ParallelFor& parallel_for, Impl impl) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  const int64_t pixels = OutPixels(s);
  if (pixels == 0) return;
  if (binary_input) {
    return BitpackedForwardWith(
        s, x, PackBitFilter(s, w, scale, parallel_for, impl), y, parallel_for);
  }
  impl = PlanOf<T>(ConvOp::kForward, s, false, false, impl);
  if constexpr (std::is_same<T, float>::value) {
    if (impl == Impl::kAmx) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      if (amx::Forward(s, x, w, AlphaOrNull(alpha), y, parallel_for)) return;
    }
  }
  const PackedB<T> w_hat =
      PackedSignedWeights(s, w, scale,
                          /*transpose=*/false, impl, parallel_for);
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
                               const ParallelFor& parallel_for, Impl impl) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  const int64_t C = s.in_c;
  const int64_t in_rows = s.batch * s.in_h;
  const int64_t row_len = s.in_w * C;
  if (in_rows * row_len == 0) return;
  impl = PlanOf<T>(ConvOp::kBackpropInput, s, act_est != Estimator::kNone,
                   false, impl);
  if constexpr (std::is_same<T, float>::value) {
    if (OutPixels(s) > 0 && impl == Impl::kAmx) {
      const std::vector<float> alpha = FilterAlphaFloats(s, w, scale);
      if (amx::BackpropInput(s, x, w, dy, act_est, clip, AlphaOrNull(alpha), dx,
                             parallel_for)) {
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

  // The scatter below only adds, and may never touch some pixels.
  if (!summed) {
    parallel_for(in_rows, row_len, [&](int64_t r0, int64_t r1) {
      std::fill(dx + r0 * row_len, dx + r1 * row_len, T(0));
    });
  }

  if (!summed && OutPixels(s) > 0) {
    const PackedB<T> w_hat_t = PackedSignedWeights(
        s, w, scale, /*transpose=*/true, impl, parallel_for);
    // A band of `band` output rows scatters into input rows spanning
    // (band - 1) * stride + ek. With band * stride >= ek - stride, bands b
    // and b + 2 never touch the same input row, so all even bands (and then
    // all odd bands) of all images can run concurrently without races.
    const int64_t ek = (s.k_h - 1) * s.dil_h + 1;
    // (ek - 1) / stride == ceil((ek - stride) / stride). Bands are also at
    // least kPixelBlock pixels (or the whole image): the GEMM streams all of
    // W_hat once per call, so it needs enough rows to reuse it.
    const int64_t band =
        std::min(s.out_h, std::max({int64_t{1}, (ek - 1) / s.stride_h,
                                    (kPixelBlock + s.out_w - 1) / s.out_w}));
    const int64_t bands = (s.out_h + band - 1) / band;
    const int64_t hw = s.out_h * s.out_w;
    // Where a band is the whole image (small images, deep layers), a unit
    // takes enough whole images for a block of kPixelBlock pixels: images
    // never share input rows, and one image of 4x4 pixels would stream all
    // of W_hat (9 C N values) for 16 rows of dY.
    const int64_t images =
        bands > 1
            ? 1
            : std::max<int64_t>(1, kPixelBlock / std::max<int64_t>(hw, 1));
    for (int64_t parity = 0; parity < 2; ++parity) {
      const int64_t per_image = (bands - parity + 1) / 2;
      if (per_image == 0) continue;
      const int64_t units = (s.batch + images - 1) / images * per_image;
      const int64_t cost = images * band * s.out_w * K * N;
      parallel_for(units, cost, [&](int64_t u0, int64_t u1) {
        std::vector<T> dcol(2 * kPixelBlock * K);
        for (int64_t u = u0; u < u1; ++u) {
          const int64_t n = u / per_image * images;
          const int64_t n1 = std::min(s.batch, n + images);
          const int64_t oh0 = (parity + 2 * (u % per_image)) * band;
          const int64_t oh1 = std::min(s.out_h, oh0 + band);
          const int64_t begin = n * hw + oh0 * s.out_w;
          const int64_t end = (n1 - 1) * hw + oh1 * s.out_w;
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

  ApplyInputEstimator(s, x, act_est, clip, dx, parallel_for);
}

template <typename T>
void BinaryConv2DBackpropFilter(const ConvShape& s, const T* x, const T* w,
                                const T* dy, Estimator act_est, Estimator w_est,
                                double clip, Scale scale, T* dw,
                                const ParallelFor& parallel_for, Impl impl) {
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
                              AlphaOrNull(alpha), dw, parallel_for)) {
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
  template BitFilter<T> PackBitFilter<T>(const ConvShape&, const T*, Scale,    \
                                         const ParallelFor&, Impl);            \
  template bool BitFilterFits<T>(const BitFilter<T>&, const ConvShape&, Scale, \
                                 Impl);                                        \
  template void BinaryConv2DForwardBinary<T>(                                  \
      const ConvShape&, const T*, const BitFilter<T>&, T*, const ParallelFor&, \
      const OutputAffine<T>*);                                                 \
  template std::vector<float> FilterAlphaFloats<T>(const ConvShape&, const T*, \
                                                   Scale);                     \
  template void BinaryConv2DForward<T>(const ConvShape&, const T*, const T*,   \
                                       bool, Scale, T*, const ParallelFor&,    \
                                       Impl);                                  \
  template void BinaryConv2DBackpropInput<T>(                                  \
      const ConvShape&, const T*, const T*, const T*, Estimator, double,       \
      Scale, T*, const ParallelFor&, Impl);                                    \
  template void BinaryConv2DBackpropFilter<T>(                                 \
      const ConvShape&, const T*, const T*, const T*, Estimator, Estimator,    \
      double, Scale, T*, const ParallelFor&, Impl);                            \
  template void ScaleFilterGradient<T>(const ConvShape&, const T*, Estimator,  \
                                       double, Scale, T*, const ParallelFor&);

TAPEHOOK_INSTANTIATE(float)
TAPEHOOK_INSTANTIATE(double)
#undef TAPEHOOK_INSTANTIATE

}  // namespace tapehook
