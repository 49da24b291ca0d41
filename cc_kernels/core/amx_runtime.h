// AMX runtime of the kernels in amx_conv.cc: whether this compiler builds
// them (TAPEHOOK_HAVE_AMX_PATH, TAPEHOOK_AMX) and the scratch memory they
// recycle. Whether this CPU runs them is cpu.h's answer (amx::Usable).
#ifndef TAPEHOOK_CORE_AMX_RUNTIME_H_
#define TAPEHOOK_CORE_AMX_RUNTIME_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <utility>
#include <vector>

#include "geometry.h"

#if defined(__x86_64__) && defined(__linux__) &&                     \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
     (defined(__clang__) && __clang_major__ >= 12))
#define TAPEHOOK_HAVE_AMX_PATH 1
#include <immintrin.h>
#define TAPEHOOK_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_*) when
// they are inlined at -O2; a false positive, silenced for this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#else
#define TAPEHOOK_HAVE_AMX_PATH 0
#endif

namespace tapehook {
namespace amx {

// Scratch memory is recycled between calls: a fresh multi-MiB block costs a
// page fault per 4 KiB on first touch (microseconds each in a VM), as much as
// the convolution itself. Blocks are returned to this pool when a call ends
// and handed out again best-fit; at most kPoolBytes stay cached.
class ScratchPool {
 public:
  static constexpr size_t kPoolBytes = size_t{512} << 20;

  void* Take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].first >= bytes &&
            (best == free_.size() || free_[i].first < free_[best].first)) {
          best = i;
        }
      }
      if (best < free_.size()) {
        void* p = free_[best].second;
        cached_ -= free_[best].first;
        free_.erase(free_.begin() + best);
        return p;
      }
    }
    return std::aligned_alloc(64, bytes);
  }

  void Give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace_back(bytes, p);
    cached_ += bytes;
    while (cached_ > kPoolBytes) {  // drop the smallest blocks first
      auto it = std::min_element(free_.begin(), free_.end());
      cached_ -= it->first;
      std::free(it->second);
      free_.erase(it);
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, void*>> free_;
  size_t cached_ = 0;
};

inline ScratchPool& Pool() {
  static ScratchPool* pool = new ScratchPool;  // never destroyed: no exit races
  return *pool;
}

// n bf16 values of scratch, 64-byte aligned, contents undefined.
struct Buffer {
  explicit Buffer(int64_t n)
      : bytes(RoundUp(std::max<int64_t>(n, 1) * 2, 4096)),
        p(static_cast<uint16_t*>(Pool().Take(bytes))) {}
  ~Buffer() { Pool().Give(p, bytes); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  size_t bytes;
  uint16_t* p;
};

}  // namespace amx
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_AMX_RUNTIME_H_
