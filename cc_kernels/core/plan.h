// One plan per conv: which implementation runs a binary conv op.
//
// Capabilities() states what can run a conv on this CPU (features and
// switches from cpu.h, the AMX kernels' scope); the policy (Python,
// tapehook/dispatch.py) chooses one and records it on the op as its `plan`
// attr; the op checks it with Capabilities() and runs it, deciding nothing
// itself. SelectBest() is the choice for ops whose plan is empty (graphs
// written before plans existed) and for callers of the core that pass none.
#ifndef TAPEHOOK_CORE_PLAN_H_
#define TAPEHOOK_CORE_PLAN_H_

#include <cstdint>
#include <string>

#include "geometry.h"

namespace tapehook {

enum class ConvOp : int {
  kForward = 0,
  kBackpropInput = 1,
  kBackpropFilter = 2
};

// Implementations, in order of preference. The bitpacked forward (binary
// input) runs on kAvx512, kAvx2 or kPortable inner loops; the float-operand
// convs (float-input forward, both backprops) on kAmx or on the im2col GEMM
// with kAvx2 or kPortable tiles; the float32 backprops (dX, and dW of a
// binary input) also on kAvx512, the sign-table engine of lut_backprop.h
// (lut::Supports). kBest: "whatever SelectBest picks".
enum class Impl : int {
  kPortable = 0,
  kAvx2 = 1,
  kAvx512 = 2,
  kAmx = 3,
  kBest = -1,
};

// "portable", "avx2", "avx512", "amx" (and "" for kBest).
const char* ImplName(Impl impl);
// Parses ImplName's strings; false if unknown.
bool ParseImpl(const std::string& name, Impl* out);

// What the implementations' scope depends on. Sizes are -1 where unknown (a
// shape not known when a graph is traced); unknown sizes never exclude an
// implementation. pad_top / pad_left: the leading zero padding, -1 unknown;
// SAME and VALID with stride 1 always fit every implementation, so the
// policy may leave them unknown.
struct ConvQuery {
  ConvOp op = ConvOp::kForward;
  bool binary_input = false;  // x enters as sign(x) (activation estimator)
  bool packed_input = false;  // x given as packed sign / mask bits
  bool is_double = false;     // computed in double (float64), else float
  int64_t batch = -1, in_h = -1, in_w = -1, in_c = -1, out_c = -1;
  int64_t k_h = -1, k_w = -1, out_h = -1, out_w = -1;
  int64_t stride_h = 1, stride_w = 1, dil_h = 1, dil_w = 1;
  int64_t pad_top = -1, pad_left = -1;
};

// The query of one fully known conv.
ConvQuery QueryOf(ConvOp op, const ConvShape& s, bool binary_input,
                  bool packed_input, bool is_double);

// Bit (1 << Impl) set for each implementation that can run q here.
uint32_t Capabilities(const ConvQuery& q);

inline bool CanRun(uint32_t capabilities, Impl impl) {
  return impl != Impl::kBest &&
         (capabilities >> static_cast<int>(impl) & 1u) != 0;
}

// The preferred implementation among capabilities (never empty: the
// portable code runs everything).
Impl SelectBest(uint32_t capabilities);

// impl, or SelectBest's choice when impl is kBest; "" or an error naming the
// plan, what can run here and the fix, when q cannot run on impl.
std::string ResolvePlan(const ConvQuery& q, Impl* impl);

// impl when it can run q here, else SelectBest's choice: what the core's
// entry points run. kBest gets the best; an impl that cannot run here
// never reaches them from the TF ops, which refuse it (ResolvePlan), so the
// fallback only keeps a direct caller from running instructions this CPU
// lacks.
Impl RunnableOrBest(const ConvQuery& q, Impl impl);

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_PLAN_H_
