#include "plan.h"

#include "amx_conv.h"
#include "cpu.h"
#include "lut_backprop.h"

namespace tapehook {

const char* ImplName(Impl impl) {
  switch (impl) {
    case Impl::kPortable:
      return "portable";
    case Impl::kAvx2:
      return "avx2";
    case Impl::kAvx512:
      return "avx512";
    case Impl::kAmx:
      return "amx";
    case Impl::kBest:
      return "";
  }
  return "";
}

bool ParseImpl(const std::string& name, Impl* out) {
  for (Impl impl :
       {Impl::kPortable, Impl::kAvx2, Impl::kAvx512, Impl::kAmx, Impl::kBest}) {
    if (name == ImplName(impl)) {
      *out = impl;
      return true;
    }
  }
  return false;
}

ConvQuery QueryOf(ConvOp op, const ConvShape& s, bool binary_input,
                  bool packed_input, bool is_double) {
  ConvQuery q;
  q.op = op;
  q.binary_input = binary_input;
  q.packed_input = packed_input;
  q.is_double = is_double;
  q.batch = s.batch, q.in_h = s.in_h, q.in_w = s.in_w, q.in_c = s.in_c;
  q.out_c = s.out_c, q.k_h = s.k_h, q.k_w = s.k_w;
  q.out_h = s.out_h, q.out_w = s.out_w;
  q.stride_h = s.stride_h, q.stride_w = s.stride_w;
  q.dil_h = s.dil_h, q.dil_w = s.dil_w;
  q.pad_top = s.pad_top, q.pad_left = s.pad_left;
  return q;
}

uint32_t Capabilities(const ConvQuery& q) {
  auto bit = [](Impl impl) { return 1u << static_cast<int>(impl); };
  uint32_t caps = bit(Impl::kPortable);
  if (cpu::Avx2()) caps |= bit(Impl::kAvx2);
  if (q.op == ConvOp::kForward && q.binary_input) {  // the bitpacked forward
    if (cpu::Avx512()) caps |= bit(Impl::kAvx512);
    return caps;
  }
  if (!q.is_double && amx::Usable() && amx::Supports(q))
    caps |= bit(Impl::kAmx);
  // The float backprops' sign-table engine (lut_backprop.h).
  if (cpu::Avx512() && lut::Supports(q)) caps |= bit(Impl::kAvx512);
  return caps;
}

Impl SelectBest(uint32_t capabilities) {
  for (Impl impl : {Impl::kAmx, Impl::kAvx512, Impl::kAvx2}) {
    if (CanRun(capabilities, impl)) return impl;
  }
  return Impl::kPortable;
}

Impl RunnableOrBest(const ConvQuery& q, Impl impl) {
  const uint32_t caps = Capabilities(q);
  return CanRun(caps, impl) ? impl : SelectBest(caps);
}

std::string ResolvePlan(const ConvQuery& q, Impl* impl) {
  const uint32_t caps = Capabilities(q);
  if (*impl == Impl::kBest) {
    *impl = SelectBest(caps);
    return "";
  }
  if (CanRun(caps, *impl)) return "";
  // A conv without input or output pixels computes nothing (or zeros) on
  // every plan; a plan chosen for unknown sizes may meet one at run time.
  if (q.batch == 0 || q.in_h == 0 || q.in_w == 0 || q.out_h == 0 ||
      q.out_w == 0) {
    *impl = SelectBest(caps);
    return "";
  }
  std::string can;
  for (Impl i : {Impl::kAmx, Impl::kAvx512, Impl::kAvx2, Impl::kPortable}) {
    if (CanRun(caps, i))
      can += std::string(can.empty() ? "" : ", ") + ImplName(i);
  }
  return std::string("the op's plan '") + ImplName(*impl) +
         "' cannot run this conv on this CPU (or with the TAPEHOOK_NO_* "
         "switches set); it can run: " +
         can +
         ". The plan was chosen when the op was built (traced) elsewhere or "
         "under other switches: rebuild (retrace) the graph here, or set the "
         "op's plan attr to '' to let the kernels pick";
}

}  // namespace tapehook
