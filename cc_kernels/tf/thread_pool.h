// TF's CPU worker threads as the core's ParallelFor (core/geometry.h): what
// every CPU kernel wrapper hands the core.
#ifndef TAPEHOOK_TF_THREAD_POOL_H_
#define TAPEHOOK_TF_THREAD_POOL_H_

#include <algorithm>
#include <cstdint>
#include <functional>

#include "core/geometry.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tapehook {

inline ParallelFor ThreadPoolOf(::tensorflow::OpKernelContext* ctx) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  return [pool](int64_t total, int64_t cost,
                const std::function<void(int64_t, int64_t)>& fn) {
    if (cost == kEvenShards) {
      const int64_t threads = std::max(1, pool->NumThreads());
      pool->ParallelFor(
          total,
          ::tensorflow::thread::ThreadPool::SchedulingParams::Fixed(
              std::max<int64_t>(1, (total + threads - 1) / threads)),
          fn);
      return;
    }
    pool->ParallelFor(total, cost, fn);
  };
}

}  // namespace tapehook

#endif  // TAPEHOOK_TF_THREAD_POOL_H_
