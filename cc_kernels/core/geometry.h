// Geometry of one NHWC convolution as TensorFlow computes it, and the
// thread-pool callback every kernel takes.
#ifndef TAPEHOOK_CORE_GEOMETRY_H_
#define TAPEHOOK_CORE_GEOMETRY_H_

#include <cstdint>
#include <functional>
#include <string>

namespace tapehook {

// Geometry of one NHWC convolution. pad_top / pad_left are the zero rows and
// columns before the input; bottom / right padding is implied by out_h / out_w.
struct ConvShape {
  int64_t batch = 0, in_h = 0, in_w = 0, in_c = 0;
  int64_t k_h = 0, k_w = 0, out_c = 0;
  int64_t out_h = 0, out_w = 0;
  int64_t stride_h = 1, stride_w = 1, dil_h = 1, dil_w = 1;
  int64_t pad_top = 0, pad_left = 0;
};

enum class Padding : int { kSame = 0, kValid = 1, kExplicit = 2 };

// Fills out_h/out_w/pad_top/pad_left the way TensorFlow's Conv2D does.
// explicit_* are used only for kExplicit. Returns "" or an error message.
std::string ComputeConvGeometry(Padding padding, int64_t pad_t, int64_t pad_b,
                                int64_t pad_l, int64_t pad_r, ConvShape* s);

// Runs fn(begin, end) over [0, total) split into shards; cost_per_unit is a
// rough cycle count of one unit, or kEvenShards. The TF wrapper passes TF's
// CPU thread pool.
using ParallelFor =
    std::function<void(int64_t total, int64_t cost_per_unit,
                       const std::function<void(int64_t, int64_t)>& fn)>;

// cost_per_unit asking for one shard of equal size per thread: for work
// whose shards each re-read a shared operand, where TF's cost model (4
// shards per thread) would multiply the reads.
constexpr int64_t kEvenShards = -1;

// v rounded up to a multiple of m.
constexpr int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_GEOMETRY_H_
