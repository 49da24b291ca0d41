// The threads an interpreter's binary ops share out their work on: LiteRT's
// num_threads, as a core ParallelFor.
#ifndef TAPEHOOK_LITE_THREAD_POOL_H_
#define TAPEHOOK_LITE_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/geometry.h"

namespace tapehook {
namespace lite {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn over [0, total) in up to threads() contiguous shards (the
  // caller runs one); work too small to share (total * cost) runs inline.
  void ParallelFor(int64_t total, int64_t cost_per_unit,
                   const std::function<void(int64_t, int64_t)>& fn);
  tapehook::ParallelFor AsParallelFor();

  // Held by an op for its whole run: the pool's threads wake now, while the
  // op sets up, and poll instead of sleeping between its parallel regions
  // (a thread asleep takes longer to wake than a short region lasts).
  class Busy {
   public:
    explicit Busy(ThreadPool& pool);
    ~Busy();
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    ThreadPool& pool_;
  };

 private:
  void Work();

  std::vector<std::thread> workers_;
  std::mutex run_mutex_, mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t total_ = 0, shards_ = 0, next_ = 0;
  // Written under mutex_; atomic so that a thread may spin on them without
  // it before sleeping on a condition variable (see thread_pool.cc).
  std::atomic<int64_t> pending_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> busy_{0};
};

}  // namespace lite
}  // namespace tapehook

#endif  // TAPEHOOK_LITE_THREAD_POOL_H_
