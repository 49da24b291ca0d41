// dW of a binary-input conv as sign tables on AVX2: the avx2 plan's filter
// gradient where x enters as sign(x) (lut_backprop.h has the idea at AVX-512
// width).
//
// A table holds the 16 signed sums of dy at one output pixel of 4
// consecutive images, 8 output channels to an entry: T[j] = sum_i (bit i of
// j ? -d_i : +d_i), i < 4, one ymm each (512 bytes a table). An input
// channel's entry at a tap is picked by the signs of x at the matching input
// pixel of those 4 images ("quad image": the entries' byte offsets, expanded
// once per call), so one vaddps with its folded table load does 32
// multiply-adds. A tile of 4 input channels x 3 output channel blocks spends
// 17 loads per 12 adds. The tables depend on dy alone: every tap and input
// channel reads them, and the sums come out in HWIO order. (A ymm vpermps
// over 8-entry tables of 3 images does only 24 multiply-adds per permute.)
// Where 4 images leave slots empty (batch 1 to 3), a table sums 4
// consecutive output columns of one image instead, whichever makes fewer
// tables (bench/backprops.py --plans avx2; docs/performance.md). Zero padding
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
