// Max pool keeping each window's argmax: the forward of
// tapehook.layers.MaxPooling2D's training calls (NHWC, float32).
//
// y[n, oh, ow, c] is the maximum of its window's in-image taps, argmax the
// tap's index (ih * W + iw) * C + c within its image (TF's MaxPoolWithArgmax
// with include_batch_in_index=False). Taps are visited in row-major order;
// the first is taken, a later one only where it is strictly greater (as TF's
// CPU kernel: ties and NaNs keep the earlier tap).
#ifndef TAPEHOOK_CORE_MAX_POOL_H_
#define TAPEHOOK_CORE_MAX_POOL_H_

#include <cstdint>

#include "geometry.h"

namespace tapehook {

// s: a pool's geometry as a conv's (geometry.h's ComputeConvGeometry with
// the pool's window as the filter, dilation 1): in_c is the channels; out_c
// plays no part.
void MaxPoolArgmax(const ConvShape& s, const float* x, float* y,
                   int32_t* argmax, const ParallelFor& parallel_for);

// The same pool keeping each window's maximum as its tap, one byte per
// output element: (ih - h0) * k_w + (iw - w0) for a window starting at
// (h0, w0) (pad rows and columns count, so a tap names one input position
// without the image's size); kNoTap for a window with no tap in the image
// (not with TF's geometry). With `relu` (the input is a ReLU's output r, the
// backward the gradient of that ReLU's input): ~tap where the maximum is
// not > 0, a position whose gradient ReluGrad multiplies by 0. Needs
// k_h * k_w <= kMaxPoolTaps.
constexpr int64_t kMaxPoolTaps = 127;
constexpr int8_t kNoTap = -128;
void MaxPoolTaps(const ConvShape& s, const float* x, bool relu, float* y,
                 int8_t* taps, const ParallelFor& parallel_for);

// dx (the pool's input's shape) of dy through MaxPoolTaps' taps: each
// output element's dy added at its tap, in output order (as
// MaxPoolGradWithArgmax and MaxPoolGrad add them, so the same bits); with
// `relu`, then the positions of ~taps multiplied by 0 (as ReluGrad does:
// -0.0 and NaN kept, the same bits as MaxPoolGrad then ReluGrad); without,
// ~tap counts as tap. False where a tap is not an in-image position of its
// window (taps not from MaxPoolTaps on this geometry; dx then undefined).
bool MaxPoolTapsBackprop(const ConvShape& s, const float* dy,
                         const int8_t* taps, bool relu, float* dx,
                         const ParallelFor& parallel_for);

// The transpose of MaxPoolTapsBackprop (its derivative in dy): out (dy's
// shape) is v (the input's shape) read at each tap, with `relu` times 0 at
// ~taps (as ReluGrad's gradient then MaxPoolGradGrad). False as
// MaxPoolTapsBackprop.
bool MaxPoolTapsGather(const ConvShape& s, const float* v, const int8_t* taps,
                       bool relu, float* out, const ParallelFor& parallel_for);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_MAX_POOL_H_
