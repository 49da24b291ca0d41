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
#include <unordered_map>
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
// and handed out again best-fit among those at most twice the request (a
// larger one would be lost to the requests it fits); at most kPoolBytes stay
// cached. Requests round up to whole 4 KiB pages. The pool keeps each
// block's own size, so Give takes only the pointer: a block that recorded its
// last request's size would shrink to small requests, and big requests would
// then allocate and fault their pages in every step.
class ScratchPool {
 public:
  static constexpr size_t kPoolBytes = size_t{512} << 20;

  ScratchPool() = default;
  ScratchPool(const ScratchPool&) = delete;
  ScratchPool& operator=(const ScratchPool&) = delete;
  ~ScratchPool() {  // blocks still handed out are their takers' to give
    for (const auto& block : free_) std::free(block.second);
  }

  void* Take(size_t bytes) {
    bytes = static_cast<size_t>(
        RoundUp(static_cast<int64_t>(std::max<size_t>(bytes, 1)), 4096));
    std::lock_guard<std::mutex> lock(mu_);
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const size_t have = free_[i].first;
      if (have >= bytes && have / 2 <= bytes &&
          (best == free_.size() || have < free_[best].first)) {
        best = i;
      }
    }
    if (best < free_.size()) {
      const auto [have, p] = free_[best];
      cached_ -= have;
      free_.erase(free_.begin() + best);
      taken_[p] = have;
      return p;
    }
    void* p = std::aligned_alloc(64, bytes);
    if (p != nullptr) taken_[p] = bytes;
    return p;
  }

  void Give(void* p) {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = taken_.find(p);
    const size_t have = it->second;
    taken_.erase(it);
    free_.emplace_back(have, p);
    cached_ += have;
    while (cached_ > kPoolBytes) {  // drop the smallest blocks first
      auto smallest = std::min_element(free_.begin(), free_.end());
      cached_ -= smallest->first;
      std::free(smallest->second);
      free_.erase(smallest);
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, void*>> free_;
  std::unordered_map<void*, size_t> taken_;  // blocks handed out: their sizes
  size_t cached_ = 0;
};

inline ScratchPool& Pool() {
  static ScratchPool* pool = new ScratchPool;  // never destroyed: no exit races
  return *pool;
}

// n bf16 values of scratch, 64-byte aligned, contents undefined.
struct Buffer {
  explicit Buffer(int64_t n)
      : p(static_cast<uint16_t*>(Pool().Take(static_cast<size_t>(n) * 2))) {}
  ~Buffer() { Pool().Give(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint16_t* p;
};

}  // namespace amx
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_AMX_RUNTIME_H_
