// dW of a binary-input conv as sign tables on AVX2: the avx2 plan's filter
// gradient where x enters as sign(x) (lut_backprop.h has the idea at AVX-512
// width).
//
// A ymm vpermps takes 3-bit indices, so a table holds the 8 signed sums of
// dy at 3 consecutive output columns: T[j] = sum_i (bit i of j ? -d_i :
// +d_i), i < 3. The indices are the signs of x at the 3 matching input
// columns, 8 input channels to a vector ("triple image", expanded once per
// call). One vpermps + vaddps then does 24 multiply-adds against 8 per FMA;
// measured 2.7 G pairs/s against 6.2 G FMAs/s on a Zen 3 core (64 against
// 50 G multiply-adds/s), and the engine needs no im2col of x. Zero padding
// is counted as +1 and its sum of dy subtracted afterwards; taps that never
// meet the input are exact zeros.
//
// Every result is a fixed-order float sum per output element, independent of
// how ParallelFor shards the work (shards are output-channel ranges). Any
// channel count, kernel, stride and zero padding; dilation 1; float32.
// Entry points return false without writing anything where they do not apply
// (Usable(), dilation, no pixels); the caller then runs the avx2 plan's GEMM.
#ifndef TAPEHOOK_CORE_LUT_BACKPROP_AVX2_H_
#define TAPEHOOK_CORE_LUT_BACKPROP_AVX2_H_

#include <cstdint>

#include "geometry.h"

namespace tapehook {
namespace lut_avx2 {

// True when this compiler built the kernels and cpu::Avx2() says they may
// run here.
bool Usable();

// Raw dw = conv2d_backprop_filter(sign(x), dy) in HWIO, zero padding taps
// counting 0; the caller applies alpha * e'(W). sign(t) = +1 for t >= 0
// (-0 included), -1 below and for NaN.
bool BackpropFilter(const ConvShape& s, const float* x, const float* dy,
                    float* dw, const ParallelFor& parallel_for);

// BackpropFilter with x given as packed sign / mask bits (pack_input.h).
bool BackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                          const float* dy, float* dw,
                          const ParallelFor& parallel_for);

}  // namespace lut_avx2
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_LUT_BACKPROP_AVX2_H_
