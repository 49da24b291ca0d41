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

struct PoolShape {
  int64_t batch = 0, in_h = 0, in_w = 0, channels = 0;
  int64_t k_h = 0, k_w = 0, stride_h = 0, stride_w = 0;
  int64_t pad_top = 0, pad_left = 0, out_h = 0, out_w = 0;
};

// Fills out_h / out_w / pad_top / pad_left for SAME (same_padding) or VALID
// as TF computes them; returns "" or what is wrong.
const char* ComputePoolGeometry(bool same_padding, PoolShape* s);

void MaxPoolArgmax(const PoolShape& s, const float* x, float* y,
                   int32_t* argmax, const ParallelFor& parallel_for);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_MAX_POOL_H_
