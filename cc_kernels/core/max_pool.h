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

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_MAX_POOL_H_
