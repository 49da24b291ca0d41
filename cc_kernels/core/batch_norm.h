// Gradient of a training-mode batch norm (batch statistics) over an NHWC
// float32 tensor seen as [rows, channels], written over its incoming
// gradient: what a batch norm whose input is rebuilt in the backward
// (tapehook.layers.BatchNormalization(recompute=True)) needs, without the
// third full-size tensor (the incoming gradient, the rebuilt input and the
// input gradient) that FusedBatchNormGradV3 holds at once.
#ifndef TAPEHOOK_CORE_BATCH_NORM_H_
#define TAPEHOOK_CORE_BATCH_NORM_H_

#include <cstdint>

#include "geometry.h"

namespace tapehook {

// With x_hat = (x' - mean) * inv_std, x' = relu ? max(x, 0) : x, and
// m = rows:
//   doffset[c] = sum dy, dscale[c] = sum dy * x_hat,
//   dx = scale * inv_std * (dy - doffset / m - x_hat * dscale / m),
//   and with relu, dx = 0 where x <= 0 (the ReLU's backward).
// dx may be dy (each element is read before it is written). The sums run over
// fixed blocks of rows in float64 and are added in block order, so the result
// does not depend on the thread count.
void BatchNormGrad(const float* dy, const float* x, int64_t rows,
                   int64_t channels, const float* scale, const float* mean,
                   const float* inv_std, bool relu, float* dx, float* dscale,
                   float* doffset, const ParallelFor& parallel_for);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_BATCH_NORM_H_
