#include "cpu.h"

#include <atomic>
#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TAPEHOOK_X86 1
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define TAPEHOOK_X86 0
#endif

namespace tapehook {
namespace cpu {
namespace {

Features Detect() {
  Features f;
#if TAPEHOOK_X86
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.popcnt = __builtin_cpu_supports("popcnt");
  f.bmi2 = __builtin_cpu_supports("bmi2");
  // __builtin_cpu_supports also checks that the OS saves the zmm state.
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512vpopcntdq = __builtin_cpu_supports("avx512vpopcntdq");
  unsigned a = 0, b = 0, c = 0, d = 0;
  // F16C: CPUID.1:ECX bit 29 (its ymm state is AVX's, which avx2 checks).
  if (__get_cpuid(1, &a, &b, &c, &d)) f.f16c = (c >> 29) & 1;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.amx_bf16 = (d >> 22) & 1;
    f.amx_tile = (d >> 24) & 1;
    f.amx_int8 = (d >> 25) & 1;
  }
#if defined(__linux__)
  if (f.amx_tile) {
    // Linux hands out the 8 KiB tile state only on request (per process).
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    f.amx_granted =
        syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }
#endif
#endif
  return f;
}

bool Off(const char* name) {
  // The only getenv of the kernels: switches that describe the machine, read
  // once. Settings a user chooses reach the kernels as op attrs
  // (tapehook.config).
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

int Pack(const Switches& s) {
  return (s.no_amx ? 1 : 0) | (s.no_avx512 ? 2 : 0) | (s.no_avx2 ? 4 : 0);
}

constexpr int kFromEnvironment = -1;
std::atomic<int> g_test_switches{kFromEnvironment};

}  // namespace

const Features& Detected() {
  static const Features features = Detect();
  return features;
}

Switches FromEnvironment() {
  static const Switches env = [] {
    Switches s;
    s.no_amx = Off("TAPEHOOK_NO_AMX");
    s.no_avx512 = Off("TAPEHOOK_NO_AVX512");
    s.no_avx2 = Off("TAPEHOOK_NO_AVX2");
    return s;
  }();
  return env;
}

void SetSwitchesForTest(const Switches& switches) {
  g_test_switches.store(Pack(switches), std::memory_order_relaxed);
}

void ClearSwitchesForTest() {
  g_test_switches.store(kFromEnvironment, std::memory_order_relaxed);
}

Switches InEffect() {
  const int bits = g_test_switches.load(std::memory_order_relaxed);
  if (bits == kFromEnvironment) return FromEnvironment();
  Switches s;
  s.no_amx = bits & 1;
  s.no_avx512 = bits & 2;
  s.no_avx2 = bits & 4;
  return s;
}

bool Avx2() {
  const Features& f = Detected();
  return f.avx2 && f.fma && f.popcnt && !InEffect().no_avx2;
}

bool Avx512() {
  const Features& f = Detected();
  return f.avx512f && f.avx512bw && f.avx512vl && f.avx512vpopcntdq &&
         !InEffect().no_avx512 && Avx2();
}

bool PackInput512() {
  const Features& f = Detected();
  return f.avx512f && f.bmi2 && !InEffect().no_avx512 && Avx2();
}

bool Float512() {
  return Detected().avx512f && !InEffect().no_avx512 && Avx2();
}

bool UnpackInput512() { return Float512(); }

bool HalfConvert256() { return Detected().f16c && Avx2(); }

bool Amx() {
  const Features& f = Detected();
  return f.amx_tile && f.amx_bf16 && f.avx512f && f.avx512bw && f.amx_granted &&
         !InEffect().no_amx && Avx2();
}

}  // namespace cpu
}  // namespace tapehook
