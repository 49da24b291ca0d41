// Framework-free binary Conv2D kernels (NHWC input, HWIO filter).
//
// The math (see docs/design.md):
//   sign(t) = +1 if t >= 0 else -1
//   W_hat   = alpha * sign(W), alpha[o] = 1 or mean |W[:, :, :, o]|
//   x_hat   = sign(x) if the input is binary, else x
//   y       = conv2d(x_hat, W_hat)            zero padding pads x_hat with 0
//   dW      = conv2d_backprop_filter(x_hat, dY) * alpha * e'(W)
//   dX      = conv2d_backprop_input(W_hat, dY) [* e'(x) if the input is binary]
// alpha is a constant in the backward pass. Every kernel reads the latent
// (float) W and x and applies sign, alpha and the estimator masks itself.
#ifndef TAPEHOOK_CORE_BINARY_CONV_H_
#define TAPEHOOK_CORE_BINARY_CONV_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "estimator.h"
#include "geometry.h"
#include "plan.h"

namespace tapehook {

// alpha[out_c] = mean |W[:, :, :, o]| as floats for Scale::kMeanAbs (what
// the AMX kernels take), empty for Scale::kNone.
template <typename T>
std::vector<float> FilterAlphaFloats(const ConvShape& s, const T* w,
                                     Scale scale);

// FilterAlphaFloats' result as the kernels' alpha pointer (null: no scale).
inline const float* AlphaOrNull(const std::vector<float>& alpha) {
  return alpha.empty() ? nullptr : alpha.data();
}

// Every entry point runs the implementation `impl` (plan.h), which the
// caller chose from Capabilities(); kBest: SelectBest's.

// How the AMX backprops split their float dy into bf16 parts (amx_conv.h):
// three, every product exact (kExact), or two, dy to 16 significant bits
// (kBf16x2, the opt-in). The value is the number of parts. The caller
// chooses (the TF ops' backprop_dy attr); the other implementations are exact
// fp32 and ignore it.
enum class DySplit : int { kExact = 3, kBf16x2 = 2 };

// y[batch, out_h, out_w, out_c] = conv2d(x_hat, W_hat). With binary_input
// and `threshold` ([in_c]: RSign's beta), x_hat = sign(x - threshold), the
// difference rounded to T as a separate subtraction rounds it.
template <typename T>
void BinaryConv2DForward(const ConvShape& s, const T* x, const T* w,
                         bool binary_input, Scale scale, T* y,
                         const ParallelFor& parallel_for,
                         Impl impl = Impl::kBest, const T* threshold = nullptr);

// The filter side of the fully binary forward (BinaryConv2DForward with
// binary_input): W's signs packed 64 input channels to a word, each tap's
// popcount (what a zero padding tap adds) and alpha. It depends only on W,
// the filter geometry, the scale and the CPU tier that packed it, so a
// caller may keep it while W is unchanged (the TF op does, see
// cc_kernels/tf/binary_conv_ops.cc).
template <typename T>
struct BitFilter {
  int64_t k_h = 0, k_w = 0, in_c = 0, out_c = 0;
  Scale scale = Scale::kNone;
  int isa = 0;  // the tier that packed it (binary_conv.cc's BitIsa)
  int64_t n_pad = 0;
  std::vector<uint64_t> words;  // [taps * words per pixel][n_pad]
  // The AVX2 tier's layout instead of words (which it leaves empty): the
  // nibble form of simd_avx2.h, [n_pad / 16][taps * words per pixel]
  // [lo | hi][16].
  std::vector<uint64_t> nibbles;
  std::vector<int32_t> tap_count;  // [taps][out_c]
  std::vector<T> alpha;            // [out_c]
};

// IR-Net's balanced weights of an HWIO filter, per output channel o over
// its k_h * k_w * in_c values: W - mean (kMean), (W - mean) / sqrt(var +
// 1e-12) (kStd, population variance), as tapehook/reference.py's
// balanced_kernel computes them in TF (sums here in double, each result
// rounded to T once: the same values to rounding; the sign of W - mean can
// differ only for a weight within rounding of its channel's mean).
enum class Balance : int { kNone = 0, kMean = 1, kStd = 2 };
bool ParseBalance(const std::string& name, Balance* out);
template <typename T>
std::vector<T> BalancedFilter(const ConvShape& s, const T* w, Balance balance);

template <typename T>
BitFilter<T> PackBitFilter(const ConvShape& s, const T* w, Scale scale,
                           const ParallelFor& parallel_for,
                           Impl impl = Impl::kBest);

// Whether f serves a conv of geometry s with this scale on impl's tier.
template <typename T>
bool BitFilterFits(const BitFilter<T>& f, const ConvShape& s, Scale scale,
                   Impl impl = Impl::kBest);

// A per-output-channel affine transform applied as the fully binary forward
// writes its outputs (an inference batch norm folded in):
//   y = fma(alpha[o] * multiplier[o], relu ? max(dot, 0) : dot, offset[o])
// with dot the integer count, so y = multiplier * (relu of the conv's output)
// + offset up to float rounding (alpha >= 0). [out_c] each. With `addend`
// (shaped as y: a residual connection folded in too), that value rounded to
// T and then + addend[pixel][o]: the sum a separate add of the two would
// make, to the bit. addend may be y itself (written in place).
template <typename T>
struct OutputAffine {
  const T* multiplier = nullptr;
  const T* offset = nullptr;
  bool relu = false;
  const T* addend = nullptr;
};

// BinaryConv2DForward(s, x, w, /*binary_input=*/true, scale, y) given
// f = PackBitFilter(s, w, scale) with BitFilterFits(f, s, scale): the same
// output, bit for bit; with `affine`, that output transformed by it; with
// `threshold`, as BinaryConv2DForward's.
template <typename T>
void BinaryConv2DForwardBinary(const ConvShape& s, const T* x,
                               const BitFilter<T>& f, T* y,
                               const ParallelFor& parallel_for,
                               const OutputAffine<T>* affine = nullptr,
                               const T* threshold = nullptr);

// dx[batch, in_h, in_w, in_c]. x is read only when act_est != kNone.
template <typename T>
void BinaryConv2DBackpropInput(const ConvShape& s, const T* x, const T* w,
                               const T* dy, Estimator act_est, double clip,
                               Scale scale, T* dx,
                               const ParallelFor& parallel_for,
                               Impl impl = Impl::kBest,
                               DySplit dy_split = DySplit::kExact);

// dw[k_h, k_w, in_c, out_c]. act_est == kNone means the input is float.
template <typename T>
void BinaryConv2DBackpropFilter(const ConvShape& s, const T* x, const T* w,
                                const T* dy, Estimator act_est, Estimator w_est,
                                double clip, Scale scale, T* dw,
                                const ParallelFor& parallel_for,
                                Impl impl = Impl::kBest,
                                DySplit dy_split = DySplit::kExact);

// dw *= alpha * e'(W) in place (alpha of `scale`, e' of w_est): what every
// backprop-filter plan applies to its sums conv2d_backprop_filter(x_hat, dY).
template <typename T>
void ScaleFilterGradient(const ConvShape& s, const T* w, Estimator w_est,
                         double clip, Scale scale, T* dw,
                         const ParallelFor& parallel_for);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_BINARY_CONV_H_
