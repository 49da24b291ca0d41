// The two float-operand backprops of a binary conv on AVX-512 without AMX,
// as sign tables ("four Russians"): the avx512 plan of the backprops.
//
// One operand of every product is +1 or -1 (sign(W) in dX, sign(x) in a
// fully binary dW). For four floats g0..g3 the table T[j] = sum_i (bit i of
// j ? -g_i : +g_i), j < 16, fits one zmm; a vpermps with a zmm of 4-bit
// indices (the signs of 4 operands for each of 16 lanes) then gives 16 lanes
// their signed sums of 4 products: 64 multiply-adds per vpermps + vaddps,
// against 16 per FMA (timings against oneDNN: bench/lut_backprop/REPORT.md
// and docs/performance.md).
//
// dX: the tables hold alpha[co] * dy over 4 output channels, the indices
// sign(W) (built per call from the float W); input positions are grouped by
// which taps reach them (borders, stride parity), so no zero tap is summed.
// dW: the tables hold dy of 4 consecutive output columns, the indices the
// signs of x at the 4 matching input columns ("nibble image", expanded once
// per call). Zero padding is counted as +1 by the kernel and its sum of dy
// subtracted afterwards; taps that never meet the input are exact zeros.
//
// Every result is a fixed-order float sum per output element, independent
// of how ParallelFor shards the work. Channel counts are padded to 16 lanes
// internally; any stride, kernel up to kMaxTaps taps, any zero padding.
// Entry points return false without writing anything where they do not
// apply (Supports, cpu::Avx512(), no pixels); the caller then runs another
// plan's code.
#ifndef TAPEHOOK_CORE_LUT_BACKPROP_H_
#define TAPEHOOK_CORE_LUT_BACKPROP_H_

#include <cstdint>

#include "geometry.h"
#include "plan.h"

namespace tapehook {
namespace lut {

// Kernel taps (k_h * k_w) the engines take: dX keeps a bit per tap.
constexpr int64_t kMaxTaps = 31;

// True when this compiler built the kernels and cpu::Avx512() says they
// may run here.
bool Usable();

// Whether the engines take this conv (ignores Usable(); sizes of -1 count as
// taken): float32, dilation 1, dX with any input or dW with a binary input,
// at most kMaxTaps taps. The one statement of their scope: Capabilities()
// (plan.h) asks it.
bool Supports(const ConvQuery& q);

// Raw dx = conv2d_backprop_input(alpha * sign(W), dy), without any
// activation estimator mask. alpha[out_c] may be null (no scale).
bool BackpropInput(const ConvShape& s, const float* w, const float* alpha,
                   const float* dy, float* dx, const ParallelFor& parallel_for);

// Raw dw = conv2d_backprop_filter(sign(x), dy) in HWIO, zero padding taps
// counting 0; the caller applies alpha * e'(W). sign(t) = +1 for t >= 0
// (-0 included), -1 below and for NaN.
bool BackpropFilter(const ConvShape& s, const float* x, const float* dy,
                    float* dw, const ParallelFor& parallel_for);

// BackpropFilter with x given as packed sign / mask bits (pack_input.h).
bool BackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                          const float* dy, float* dw,
                          const ParallelFor& parallel_for);

}  // namespace lut
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_LUT_BACKPROP_H_
