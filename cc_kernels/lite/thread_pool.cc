#include "thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tapehook {
namespace lite {

namespace {
// Below this much work (units times cycles per unit) waking threads costs
// more than it saves.
constexpr int64_t kMinParallelCost = 20000;
// Set on the pool's threads and on a caller while it runs its shards: a
// nested ParallelFor there runs inline (waiting on the pool would deadlock).
thread_local bool in_pool = false;

// How long a thread polls for what it waits on before it sleeps: a binary
// op's parallel regions follow each other closely, and a condition
// variable's sleep and wake cost more than that (a context switch each).
constexpr auto kSpin = std::chrono::microseconds(30);

template <typename Ready>
void SpinUntil(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (int i = 0; !ready(); ++i) {
#if defined(__x86_64__)
    _mm_pause();
#endif
    if (i % 64 == 63 && std::chrono::steady_clock::now() > until) return;
  }
}
}  // namespace

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Work(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::Work() {
  in_pool = true;
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    auto ready = [&] {
      return stop_ || (generation_ != seen && next_ < shards_);
    };
    if (!ready()) {
      lock.unlock();
      SpinUntil([&] { return stop_ || generation_.load() != seen; });
      lock.lock();
    }
    wake_.wait(lock, ready);
    if (stop_) return;
    while (next_ < shards_) {
      const int64_t shard = next_++;
      const auto* fn = fn_;
      const int64_t begin = total_ * shard / shards_;
      const int64_t end = total_ * (shard + 1) / shards_;
      lock.unlock();
      (*fn)(begin, end);
      lock.lock();
      if (--pending_ == 0) done_.notify_all();
    }
    seen = generation_;
  }
}

void ThreadPool::ParallelFor(int64_t total, int64_t cost_per_unit,
                             const std::function<void(int64_t, int64_t)>& fn) {
  if (total <= 0) return;
  const bool small =
      cost_per_unit >= 0 &&
      total * std::max<int64_t>(cost_per_unit, 1) < kMinParallelCost;
  if (workers_.empty() || total == 1 || small || in_pool) {
    fn(0, total);
    return;
  }
  // One caller at a time: interpreters with the same thread count share a
  // pool (see lce_ops.cc).
  std::lock_guard<std::mutex> one_caller(run_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  fn_ = &fn;
  total_ = total;
  shards_ = std::min<int64_t>(total, threads());
  next_ = 1;  // the caller runs shard 0
  pending_ = shards_;
  ++generation_;
  lock.unlock();
  wake_.notify_all();
  in_pool = true;
  fn(0, total / shards_);
  lock.lock();
  --pending_;
  while (next_ < shards_) {
    const int64_t shard = next_++;
    lock.unlock();
    fn(total * shard / shards_, total * (shard + 1) / shards_);
    lock.lock();
    --pending_;
  }
  in_pool = false;
  if (pending_ != 0) {
    lock.unlock();
    SpinUntil([&] { return pending_.load() == 0; });
    lock.lock();
  }
  done_.wait(lock, [&] { return pending_ == 0; });
  shards_ = 0;
  fn_ = nullptr;
}

tapehook::ParallelFor ThreadPool::AsParallelFor() {
  return [this](int64_t total, int64_t cost,
                const std::function<void(int64_t, int64_t)>& fn) {
    ParallelFor(total, cost, fn);
  };
}

}  // namespace lite
}  // namespace tapehook
