// Backprops of a binary-activation conv whose input is kept as packed bits.
#ifndef TAPEHOOK_CORE_PACKED_BACKPROP_H_
#define TAPEHOOK_CORE_PACKED_BACKPROP_H_

#include <cstdint>

#include "binary_conv.h"
#include "pack_input.h"
#include "plan.h"

namespace tapehook {

// Backprops of a binary-activation conv with the ste_sign input estimator,
// its input given as packed sign / mask bits (what the backward keeps):
// the same results as BinaryConv2DBackpropInput / Filter on x with
// act_est = kSteSign. On AMX (impl kAmx, float) and on the sign-table
// engine (impl kAvx512, float; lut_backprop.h) the kernels read the bits
// directly, as does the float dX of the AVX2 and portable tiers (a GEMM
// that needs no x, then the mask bits); elsewhere a float stand-in for x
// with the same signs and masks is built.
template <typename T>
void BinaryConv2DBackpropInputPacked(const ConvShape& s, const uint8_t* packed,
                                     const T* w, const T* dy, double clip,
                                     Scale scale, T* dx,
                                     const ParallelFor& parallel_for,
                                     Impl impl = Impl::kBest,
                                     DySplit dy_split = DySplit::kExact);
template <typename T>
void BinaryConv2DBackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                                      const T* w, const T* dy, Estimator w_est,
                                      double clip, Scale scale, T* dw,
                                      const ParallelFor& parallel_for,
                                      Impl impl = Impl::kBest,
                                      DySplit dy_split = DySplit::kExact);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_PACKED_BACKPROP_H_
