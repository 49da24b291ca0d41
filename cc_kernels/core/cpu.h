// What this CPU (and process) lets the kernels use: the one place where CPU
// features are detected and the TAPEHOOK_NO_* switches are read.
//
// Features are detected once (CPUID, and on Linux the AMX tile-state
// permission, which is granted per process). The switches TAPEHOOK_NO_AMX,
// TAPEHOOK_NO_AVX512 and TAPEHOOK_NO_AVX2 are read once, at first use; a
// value other than "" or "0" turns a tier off. TAPEHOOK_NO_AVX2 asks for the
// portable code and turns off every tier above it. Tests pin tiers with
// SetSwitchesForTest instead of setenv.
#ifndef TAPEHOOK_CORE_CPU_H_
#define TAPEHOOK_CORE_CPU_H_

namespace tapehook {
namespace cpu {

// Raw CPU (and OS) features, detected once.
struct Features {
  bool avx2 = false, fma = false, popcnt = false, bmi2 = false;
  bool f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false;
  bool avx512vpopcntdq = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool amx_granted = false;  // Linux gave this process the tile state
};
const Features& Detected();

// Tiers turned off by the environment (or a test).
struct Switches {
  bool no_amx = false, no_avx512 = false, no_avx2 = false;
};
// The environment's switches, read once.
Switches FromEnvironment();
// Replaces the switches in effect (thread-safe; meant for tests, which
// restore them with ClearSwitchesForTest).
void SetSwitchesForTest(const Switches& switches);
void ClearSwitchesForTest();
Switches InEffect();

// What the kernels may use now: the features, less the switches.
// AVX2 tier: AVX2 + FMA + POPCNT (float GEMM tiles, nibble popcounts).
bool Avx2();
// AVX-512 bitpacked tier: F/BW/VL + VPOPCNTDQ, and the AVX2 tier.
bool Avx512();
// AVX-512F float loops (the optimizer's update): AVX-512F and the AVX2 tier.
bool Float512();
// AVX-512F (+ BMI2 for packing) loops of the packed-input format.
bool PackInput512();
bool UnpackInput512();  // Float512()
// F16C conversions (float <-> binary16, 8 at a time) and the AVX2 tier.
bool HalfConvert256();
// AMX-TILE + AMX-BF16 + AVX-512 F/BW, the Linux grant, and the AVX2 tier.
bool Amx();

}  // namespace cpu
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_CPU_H_
