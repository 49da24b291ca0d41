// Backprops of a binary-activation conv whose input is kept as packed sign /
// mask bits (pack_input.h): the AMX kernels and the sign-table ones
// (lut_backprop.h, plan avx512) read the bits, as does the float dX of plans
// avx2 and portable; the other plans run the float kernels on a stand-in
// input with the same signs and masks.
#include "packed_backprop.h"

#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx_conv.h"
#include "binary_conv.h"
#include "lut_backprop.h"
#include "lut_backprop_avx2.h"
#include "pack_input.h"
#include "plan.h"
#include "simd_avx2.h"

namespace tapehook {

namespace {

// A float input with the packed signs and masks: +-clip where the mask is
// set, +-(2 clip + 1) where not, so sign() and 1{|t| <= clip} give them back.
template <typename T>
std::vector<T> StandIn(const ConvShape& s, const uint8_t* packed, double clip,
                       const ParallelFor& parallel_for) {
  const int64_t rows = s.batch * s.in_h * s.in_w, channels = s.in_c;
  std::vector<T> x_hat(rows * channels), mask(rows * channels);
  UnpackSignMask(packed, rows, channels, x_hat.data(), mask.data(),
                 parallel_for);
  const T in = static_cast<T>(clip), out = static_cast<T>(2 * clip + 1);
  for (int64_t i = 0; i < rows * channels; ++i) {
    x_hat[i] *= mask[i] != T(0) ? in : out;
  }
  return x_hat;
}

// dx *= the packed ste_sign mask (bit 6 - 2 (c % 4) of byte c / 4 of a row),
// on the AVX2 tiles for every tier above portable (each implies AVX2).
void ApplyPackedMask(const ConvShape& s, const uint8_t* packed, float* dx,
                     const ParallelFor& parallel_for, Impl impl) {
  const int64_t rows = s.batch * s.in_h * s.in_w, channels = s.in_c;
  const int64_t row_bytes = PackedBytes(channels);
  parallel_for(rows, channels * 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* bits = packed + r * row_bytes;
      float* g = dx + r * channels;
#if TAPEHOOK_HAVE_AVX2_PATH
      if (impl != Impl::kPortable) {
        simd::ScaleByMaskBits(bits, channels, g);
        continue;
      }
#endif
      for (int64_t c = 0; c < channels; ++c) {
        g[c] *= (bits[c / 4] >> (6 - 2 * (c % 4)) & 1) ? 1.0f : 0.0f;
      }
    }
  });
}

}  // namespace

template <typename T>
void BinaryConv2DBackpropInputPacked(const ConvShape& s, const uint8_t* packed,
                                     const T* w, const T* dy, double clip,
                                     Scale scale, T* dx,
                                     const ParallelFor& parallel_for, Impl impl,
                                     DySplit dy_split) {
  impl = RunnableOrBest(
      QueryOf(ConvOp::kBackpropInput, s, true, true, std::is_same_v<T, double>),
      impl);
  if constexpr (std::is_same<T, float>::value) {
    if (impl == Impl::kAmx) {
      const std::vector<float> a = FilterAlphaFloats(s, w, scale);
      if (amx::BackpropInputPacked(s, packed, w, dy, AlphaOrNull(a), dx,
                                   parallel_for, dy_split)) {
        return;
      }
    }
    if (impl == Impl::kAvx512) {
      const std::vector<float> a = FilterAlphaFloats(s, w, scale);
      if (lut::BackpropInput(s, w, AlphaOrNull(a), dy, dx, parallel_for)) {
        ApplyPackedMask(s, packed, dx, parallel_for, impl);
        return;
      }
    }
  }
  if constexpr (std::is_same<T, float>::value) {
    if (impl == Impl::kAvx2 || impl == Impl::kPortable) {
      // The GEMM's sums, then the mask from the bits: no float stand-in
      // (two unpacked copies of x and a pass over them) for a mask that
      // multiplies by the same 1 or 0.
      BinaryConv2DBackpropInput(s, static_cast<const T*>(nullptr), w, dy,
                                Estimator::kNone, clip, scale, dx, parallel_for,
                                impl);
      ApplyPackedMask(s, packed, dx, parallel_for, impl);
      return;
    }
  }
  const std::vector<T> x = StandIn<T>(s, packed, clip, parallel_for);
  BinaryConv2DBackpropInput(s, x.data(), w, dy, Estimator::kSteSign, clip,
                            scale, dx, parallel_for, impl, dy_split);
}

template <typename T>
void BinaryConv2DBackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                                      const T* w, const T* dy, Estimator w_est,
                                      double clip, Scale scale, T* dw,
                                      const ParallelFor& parallel_for,
                                      Impl impl, DySplit dy_split) {
  impl = RunnableOrBest(QueryOf(ConvOp::kBackpropFilter, s, true, true,
                                std::is_same_v<T, double>),
                        impl);
  if constexpr (std::is_same<T, float>::value) {
    if (impl == Impl::kAmx) {
      const std::vector<float> a = FilterAlphaFloats(s, w, scale);
      if (amx::BackpropFilterPacked(s, packed, w, dy, w_est, clip,
                                    AlphaOrNull(a), dw, parallel_for,
                                    dy_split)) {
        return;
      }
    }
    if ((impl == Impl::kAvx512 &&
         lut::BackpropFilterPacked(s, packed, dy, dw, parallel_for)) ||
        (impl == Impl::kAvx2 &&
         lut_avx2::BackpropFilterPacked(s, packed, dy, dw, parallel_for))) {
      ScaleFilterGradient(s, w, w_est, clip, scale, dw, parallel_for);
      return;
    }
  }
  const std::vector<T> x = StandIn<T>(s, packed, clip, parallel_for);
  BinaryConv2DBackpropFilter(s, x.data(), w, dy, Estimator::kSteSign, w_est,
                             clip, scale, dw, parallel_for, impl, dy_split);
}

template void BinaryConv2DBackpropInputPacked<float>(
    const ConvShape&, const uint8_t*, const float*, const float*, double, Scale,
    float*, const ParallelFor&, Impl, DySplit);
template void BinaryConv2DBackpropInputPacked<double>(
    const ConvShape&, const uint8_t*, const double*, const double*, double,
    Scale, double*, const ParallelFor&, Impl, DySplit);
template void BinaryConv2DBackpropFilterPacked<float>(
    const ConvShape&, const uint8_t*, const float*, const float*, Estimator,
    double, Scale, float*, const ParallelFor&, Impl, DySplit);
template void BinaryConv2DBackpropFilterPacked<double>(
    const ConvShape&, const uint8_t*, const double*, const double*, Estimator,
    double, Scale, double*, const ParallelFor&, Impl, DySplit);

}  // namespace tapehook
