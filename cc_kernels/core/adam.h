// Adam's update and a weight clip in one pass over a float32 variable, its
// gradient and both moments: what tapehook.optimizers.Adam runs for a
// variable whose constraint is a WeightClip, where Keras would run TF's
// ResourceApplyAdam and then the clip (two more passes over the variable and
// a copy back into it).
#ifndef TAPEHOOK_CORE_ADAM_H_
#define TAPEHOOK_CORE_ADAM_H_

#include <cstdint>

#include "geometry.h"

namespace tapehook {

// The step's scalars, computed in float32 as TF's ResourceApplyAdam computes
// them (AdamScalars).
struct AdamStep {
  float alpha;            // lr * sqrt(1 - beta2_power) / (1 - beta1_power)
  float one_minus_beta1;  // 1 - beta1
  float one_minus_beta2;  // 1 - beta2
  float epsilon;
  float clip;  // var is clipped to [-clip, clip] after the update
};

AdamStep AdamScalars(float lr, float beta1_power, float beta2_power,
                     float beta1, float beta2, float epsilon, float clip);

// Per element, in this order and in float32 without fused multiply-adds (the
// order TF's CPU kernel evaluates):
//   m += (g - m) * (1 - beta1)
//   v += (g * g - v) * (1 - beta2)
//   var -= (m * alpha) / (sqrt(v) + epsilon)
//   var = min(max(var, -clip), clip)   (NaN stays NaN, as tf.clip_by_value)
// Every tier (AVX-512F, AVX2, portable) gives the same bits.
void AdamClipUpdate(float* var, float* m, float* v, const float* grad,
                    int64_t n, const AdamStep& step,
                    const ParallelFor& parallel_for);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_ADAM_H_
