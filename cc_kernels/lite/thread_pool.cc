#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

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

// How long the caller polls for the pool's threads to finish before it
// sleeps: a condition variable's sleep and wake cost more than that (a
// context switch each).
constexpr auto kSpin = std::chrono::microseconds(30);
// How long a pool thread keeps polling after the last op ended (Busy): the
// float ops LiteRT runs between two binary ops are usually shorter, and a
// thread asleep takes longer to wake (on a VM especially) than many of the
// next op's regions last. It polls with sched_yield there, which lets XNNPACK's
// own threads have this core; while an op runs, with pause (nothing else runs
// then).
constexpr auto kIdlePoll = std::chrono::microseconds(200);

void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Polls until ready(), or until `poll` has passed since busy() was last
// true.
template <typename Ready, typename Hold>
void PollUntil(Ready ready, Hold busy, std::chrono::microseconds poll,
               bool yield_when_idle) {
  auto until = std::chrono::steady_clock::now() + poll;
  bool held = busy();
  for (int i = 0; !ready(); ++i) {
    if (yield_when_idle && !held) {
      sched_yield();
    } else {
      Pause();
      if (i % 64 != 63) continue;
    }
    const auto now = std::chrono::steady_clock::now();
    held = busy();
    if (held) {
      until = now + poll;
    } else if (now > until) {
      return;
    }
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
  // Named so that a profile (top -H, perf) tells these from LiteRT's own.
  pthread_setname_np(pthread_self(), "tapehook-lite");
  in_pool = true;
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    lock.unlock();
    PollUntil([&] { return stop_ || generation_.load() != seen; },
              [&] { return busy_.load() > 0; }, kIdlePoll, true);
    lock.lock();
    // Sleep until there is a region to join, or an op starts (Busy): then
    // poll again.
    bool join = false;
    while (!stop_ && !join) {
      if (generation_ != seen) {
        join = next_ < shards_;
        if (!join) seen = generation_;  // the caller ran every shard
      } else if (busy_ > 0) {
        break;
      } else {
        wake_.wait(lock);
      }
    }
    if (stop_) return;
    if (!join) continue;
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

ThreadPool::Busy::Busy(ThreadPool& pool) : pool_(pool) {
  if (pool_.workers_.empty()) return;
  {
    // Under the lock: a thread that has just seen busy_ == 0 is then asleep
    // on wake_, and is woken.
    std::lock_guard<std::mutex> lock(pool_.mutex_);
    ++pool_.busy_;
  }
  pool_.wake_.notify_all();
}

ThreadPool::Busy::~Busy() {
  if (!pool_.workers_.empty()) --pool_.busy_;
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
    PollUntil([&] { return pending_.load() == 0; }, [] { return false; }, kSpin,
              false);
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
