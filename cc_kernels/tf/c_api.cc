// How many times each compiled kernel ran (CountDispatch), and the plain C
// entry points tapehook/kernels.py reads with ctypes: those counts, build
// facts, the capability query and the test switches.
#include <atomic>
#include <cstdint>

#include "core/amx_conv.h"
#include "core/cpu.h"
#include "core/plan.h"
#include "tf/conv_attrs.h"

#ifndef TAPEHOOK_TF_VERSION
#define TAPEHOOK_TF_VERSION "unknown"
#endif

namespace tapehook {
namespace {

// How many times each compiled kernel (CPU or GPU) ran, in any execution mode.
std::atomic<int64_t> g_counts[kNumKinds];

}  // namespace

void CountDispatch(CountKind kind) {
  g_counts[kind].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace tapehook

// Plain C entry points read with ctypes: dispatch counters and build facts.
extern "C" {
int64_t tapehook_dispatch_count(int kind) {
  if (kind < 0 || kind >= tapehook::kNumKinds) return -1;
  return tapehook::g_counts[kind].load(std::memory_order_relaxed);
}
void tapehook_reset_dispatch_counts() {
  for (auto& c : tapehook::g_counts) c.store(0, std::memory_order_relaxed);
}
const char* tapehook_built_tf_version() { return TAPEHOOK_TF_VERSION; }
// 1 when the float-operand kernels can run on AMX (see core/amx_conv.h).
int tapehook_amx_usable() { return tapehook::amx::Usable() ? 1 : 0; }

// The capability query (core/plan.h) for tapehook.dispatch: bit (1 << impl)
// per implementation that can run the conv, impl numbered as
// tapehook::Impl. geometry: batch, in_h, in_w, in_c, out_c, k_h, k_w, out_h,
// out_w, stride_h, stride_w, dil_h, dil_w, pad_top, pad_left (-1: unknown).
uint32_t tapehook_conv_capabilities(int op, int binary_input, int packed_input,
                                    int is_double, const int64_t* geometry) {
  if (op < 0 || op > 2) return 0;
  tapehook::ConvQuery q;
  q.op = static_cast<tapehook::ConvOp>(op);
  q.binary_input = binary_input != 0;
  q.packed_input = packed_input != 0;
  q.is_double = is_double != 0;
  int64_t* fields[] = {&q.batch, &q.in_h,     &q.in_w,     &q.in_c,
                       &q.out_c, &q.k_h,      &q.k_w,      &q.out_h,
                       &q.out_w, &q.stride_h, &q.stride_w, &q.dil_h,
                       &q.dil_w, &q.pad_top,  &q.pad_left};
  for (int i = 0; i < 15; ++i) *fields[i] = geometry[i];
  return tapehook::Capabilities(q);
}

// Test hook: the TAPEHOOK_NO_* switches in effect (bits: 1 no AMX, 2 no
// AVX-512, 4 no AVX2), or -1 to go back to the environment's.
void tapehook_set_switches_for_test(int bits) {
  if (bits < 0) return tapehook::cpu::ClearSwitchesForTest();
  tapehook::cpu::SetSwitchesForTest(
      {(bits & 1) != 0, (bits & 2) != 0, (bits & 4) != 0});
}
}
