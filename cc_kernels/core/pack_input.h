// Packed input of a binary-activation conv: what its backward needs from x.
//
// Per element, 2 bits: sign (x >= 0) and the ste_sign mask (|x| <= clip).
// Rows are the leading axes, channels the last axis; row r, channel c lives in
// byte r * PackedBytes(channels) + c / 4, sign bit 7 - 2 (c % 4), mask bit
// 6 - 2 (c % 4). 16x smaller than float32.
#ifndef TAPEHOOK_CORE_PACK_INPUT_H_
#define TAPEHOOK_CORE_PACK_INPUT_H_

#include <cstdint>

#include "binary_conv.h"
#include "estimator.h"

namespace tapehook {

inline int64_t PackedBytes(int64_t channels) { return (channels + 3) / 4; }

// With `threshold` ([channels], or null): the bits of x - threshold (RSign's
// shift; each difference rounded to T as a separate subtraction rounds it),
// computed a run at a time, never written out whole. The same for the
// estimator derivatives below, whose n values are then rows of `channels`.
template <typename T>
void PackSignMask(const T* x, int64_t rows, int64_t channels, double clip,
                  uint8_t* packed, const ParallelFor& parallel_for,
                  const T* threshold = nullptr);

// x_hat = +-1 from the sign bits, mask = 0 / 1 (not written where mask is
// null: a caller that needs only the signs).
template <typename T>
void UnpackSignMask(const uint8_t* packed, int64_t rows, int64_t channels,
                    T* x_hat, T* mask, const ParallelFor& parallel_for);

// The compact form of a continuous input estimator (approx_sign,
// swish_sign; TAPEHOOK_PACK_INPUTS=float16): e'(x) of n float32 values as
// IEEE binary16 bit patterns, rounded to nearest even (relative error at most
// 2^-11; values below 2^-14 keep an absolute error of at most 2^-25). e'(x)
// is computed as the float-input kernels compute it (approx_sign:
// ApproxSignGrad; swish_sign: EstimatorGrad in double, rounded to float).
void EstimatorGradHalf(const float* x, int64_t n, Estimator estimator,
                       uint16_t* half, const ParallelFor& parallel_for,
                       const float* threshold = nullptr, int64_t channels = 0);

// out = grad * e' for n values, e' as EstimatorGradHalf's binary16 bits
// (converted exactly to float32; one float32 rounding of the product).
void ScaleByHalf(const float* grad, const uint16_t* half, int64_t n, float* out,
                 const ParallelFor& parallel_for);

// The default compact form of a continuous input estimator's e'(x) for a
// float32 input (TAPEHOOK_PACK_INPUTS=1): 16-bit fixed point over the
// derivative's whole range, e' = (q - offset) * step. approx_sign: e' in
// [0, 2], offset 0, step 2 / 65535, q = round(e' * 32767.5) with e' and the
// product in float32 (absolute error at most 2^-16 + 2^-24 e'); swish_sign
// (beta 5): e' in [-0.0739 beta, beta], offset 4520, step beta / 61015, q
// from the double e' (absolute error at most 4.1e-5 + 2^-24 |e'|). Where x is
// NaN, e' = 0 (as approx_sign's float kernels give).
struct FixedDerivative {
  int32_t offset;
  float step;
};
FixedDerivative FixedDerivativeOf(Estimator estimator);

// q of n float32 values as above, rounded to nearest even.
void EstimatorGradFixed(const float* x, int64_t n, Estimator estimator,
                        uint16_t* q, const ParallelFor& parallel_for,
                        const float* threshold = nullptr, int64_t channels = 0);

// out = grad * ((q - offset) * step): e' as one float32 product, then one
// float32 rounding of grad times it.
void ScaleByFixed(const float* grad, const uint16_t* q, int64_t n,
                  Estimator estimator, float* out,
                  const ParallelFor& parallel_for);

// Exact binary16 <-> float32 conversions, round to nearest even (NaN keeps
// its sign and becomes the quiet NaN 0x7e00), one value at a time: the
// reference the vector loops agree with bit for bit.
uint16_t FloatToHalf(float value);
float HalfToFloat(uint16_t half);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_PACK_INPUT_H_
