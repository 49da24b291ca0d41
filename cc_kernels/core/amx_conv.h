// Float-operand binary conv kernels on Intel AMX (bf16 tiles), exact to fp32.
//
// Every product in these convolutions has one operand that is exactly +1, -1
// or 0 (sign(W), or sign(x) in a fully binary backprop-filter), which bf16
// holds exactly. The other operand v is a float, split into three bf16 parts
// v = hi + mid + lo by truncation: hi keeps the top 8 bits of the 24-bit
// significand, mid the next 8, lo the last 8, and the sum is exact (outside
// the subnormal range, which AMX flushes). So hi*s + mid*s + lo*s == v*s
// exactly, and each AMX dot product accumulates exact products in fp32, just
// as an fp32 GEMM does. The three parts are three K-slices of one GEMM; AMX's
// bf16 rate, far above the AVX-512 fp32 FMA rate per core, pays for them.
//
// When both operands are floats (backprop-filter of a weight-only conv), the
// products hi_x*hi_d + hi_x*mid_d + mid_x*hi_d + hi_x*lo_d + lo_x*hi_d +
// mid_x*mid_d are kept: the dropped ones (mid*lo, lo*mid, lo*lo) add up to
// less than 2^-23 of |x*d|, about one fp32 rounding.
//
// Opt-in, the backprops may split dy (the float operand of backprop-input,
// and of a binary-input backprop-filter) into two parts instead: hi by
// truncation and mid = dy - hi rounded to the nearest bf16, so hi + mid is
// dy to 16 significant bits (|dy - hi - mid| <= 2^-16 |dy|, unbiased), and
// the GEMMs do two thirds of the work. The caller says which with each
// backprop's dy_split (binary_conv.h DySplit; the TF ops' backprop_dy attr,
// set from tapehook.config). The forward and a weight-only conv's
// backprop-filter always split exactly.
//
// Scope: float32; the forward stride 1 (any dilation and padding); the
// backprops any stride (strided ones by phases, amx_conv.cc) and dilation.
// Backprop-input, and a strided backprop-filter, need pad_top <= (k_h - 1)
// * dil_h and likewise for the width, true for SAME and VALID. Each entry point
// returns false without writing anything when AMX is not usable or the shape is
// outside that scope; the caller then runs the portable / AVX2 kernels.
#ifndef TAPEHOOK_CORE_AMX_CONV_H_
#define TAPEHOOK_CORE_AMX_CONV_H_

#include <memory>

#include "binary_conv.h"
#include "plan.h"

namespace tapehook {
namespace amx {

// True when the AMX kernels may run here (cpu::Amx(), cpu.h) and this
// compiler built them.
bool Usable();

// Whether the AMX kernels take this conv (ignores Usable(); sizes of -1 count
// as taken). The one statement of their scope: Capabilities() (plan.h) asks
// it, and so do the Supports* of a known shape below.
bool Supports(const ConvQuery& q);
bool SupportsForward(const ConvShape& s);
bool SupportsBackpropInput(const ConvShape& s);
bool SupportsBackpropFilter(const ConvShape& s);

// alpha[out_c] is the per-output-channel scale (all 1 for Scale::kNone).

// y = conv2d(x, alpha * sign(W)) with a float input.
bool Forward(const ConvShape& s, const float* x, const float* w,
             const float* alpha, float* y, const ParallelFor& parallel_for);

// Forward in two steps. The filter side (sign(W) packed as the GEMM's B and
// alpha) depends only on W, alpha and the filter geometry, so a caller may
// keep it while W is unchanged (the TF op does, see
// cc_kernels/tf/binary_conv_ops.cc). PackForwardFilter returns null, and
// ForwardWith false, where Forward would return false; ForwardWith also
// returns false when f does not fit s (ForwardFilterFits). Same outputs as
// Forward, bit for bit.
struct ForwardFilter;
std::shared_ptr<const ForwardFilter> PackForwardFilter(
    const ConvShape& s, const float* w, const float* alpha,
    const ParallelFor& parallel_for);
bool ForwardFilterFits(const ForwardFilter& f, const ConvShape& s);
bool ForwardWith(const ConvShape& s, const float* x, const ForwardFilter& f,
                 float* y, const ParallelFor& parallel_for);

// dx = conv2d_backprop_input(alpha * sign(W), dy) [* e'(x) when act_est].
bool BackpropInput(const ConvShape& s, const float* x, const float* w,
                   const float* dy, Estimator act_est, double clip,
                   const float* alpha, float* dx,
                   const ParallelFor& parallel_for,
                   DySplit dy_split = DySplit::kExact);

// dw = conv2d_backprop_filter(x_hat, dy) * alpha * e'(W); x_hat = sign(x)
// when act_est != kNone, else x.
bool BackpropFilter(const ConvShape& s, const float* x, const float* w,
                    const float* dy, Estimator act_est, Estimator w_est,
                    double clip, const float* alpha, float* dw,
                    const ParallelFor& parallel_for,
                    DySplit dy_split = DySplit::kExact);

// The same two backprops for a binary-activation conv with the ste_sign
// estimator whose input is given as packed sign / mask bits
// (pack_input.h), as the backward keeps it: no float x is needed.
bool BackpropInputPacked(const ConvShape& s, const uint8_t* packed,
                         const float* w, const float* dy, const float* alpha,
                         float* dx, const ParallelFor& parallel_for,
                         DySplit dy_split = DySplit::kExact);
bool BackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                          const float* w, const float* dy, Estimator w_est,
                          double clip, const float* alpha, float* dw,
                          const ParallelFor& parallel_for,
                          DySplit dy_split = DySplit::kExact);

}  // namespace amx
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_AMX_CONV_H_
