// Adding custom ops to the tflite::MutableOpResolver that ai_edge_litert's
// InterpreterWithCustomOps hands its registerers.
//
// MutableOpResolver::AddCustom is a C++ member that ai_edge_litert does not
// export (it hides every TFLite symbol), so it cannot be called. What is
// reachable without symbols is the object itself: its virtual functions
// (through its vtable) and its members. A MutableOpResolver asks each
// resolver in its member `other_op_resolvers_` (what its protected
// ChainOpResolver appends to) for a custom op it does not hold itself; this
// file appends one of its own, whose vtable has tflite::OpResolver's layout.
// The member's offset follows from the class's declaration (TFLite's
// tflite/mutable_op_resolver.h and core/api/op_resolver.h), mirrored below
// with the same standard-library types; the hook checks the vector looks like
// one before touching it and, afterwards, that the resolver's own FindOp now
// returns this library's registration, and undoes the change if not.
#include "resolver_hook.h"

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tapehook {
namespace lite {

namespace {

struct OpaqueDelegate;
using DelegatePtr = std::unique_ptr<OpaqueDelegate, void (*)(OpaqueDelegate*)>;

// tflite::OpResolver: the virtual functions in declaration order (which is
// their vtable order), then its one member.
class OpResolverAbi {
 public:
  virtual const Registration* FindBuiltin(int32_t op, int version) const = 0;
  virtual const Registration* FindCustom(const char* op, int version) const = 0;
  virtual std::vector<DelegatePtr> GetDelegates(int num_threads) const {
    return {};
  }
  virtual std::vector<std::function<DelegatePtr(Context*)>>
  GetDelegateCreators() const {
    return {};
  }
  virtual std::vector<std::function<DelegatePtr(int)>>
  GetOpaqueDelegateCreators() const {
    return {};
  }
  virtual ~OpResolverAbi() = default;

 private:
  virtual bool MayContainUserDefinedOps() const { return true; }
  mutable std::shared_ptr<void> operators_cache_;
};

struct PairHash {
  size_t operator()(const std::pair<int32_t, int>& k) const { return 0; }
  size_t operator()(const std::pair<std::string, int>& k) const { return 0; }
};

// tflite::MutableOpResolver's members after OpResolver's.
struct MutableOpResolverAbi {
  void* vtable;
  std::shared_ptr<void> operators_cache;
  bool may_directly_contain_user_defined_ops;
  std::vector<std::function<DelegatePtr(Context*)>> delegate_creators;
  std::vector<std::function<DelegatePtr(int)>> opaque_delegate_creators;
  std::unordered_map<std::pair<int32_t, int>, Registration, PairHash> builtins;
  std::unordered_map<std::pair<std::string, int>, Registration, PairHash>
      custom_ops;
  std::vector<const OpResolverAbi*> other_op_resolvers;
};

// The resolver this library chains in: the ops of `table`, any version.
class TableResolver : public OpResolverAbi {
 public:
  explicit TableResolver(const OpTable* table) : table_(table) {}
  const Registration* FindBuiltin(int32_t, int) const override {
    return nullptr;
  }
  const Registration* FindCustom(const char* op, int) const override {
    if (op == nullptr) return nullptr;
    for (const Registration* r : *table_) {
      if (std::strcmp(r->custom_name, op) == 0) return r;
    }
    return nullptr;
  }

 private:
  const OpTable* table_;
};

// The resolver's FindOp(const char*, int), called through its vtable (slot
// 1, after FindOp(BuiltinOperator, int)) as the Itanium C++ ABI lays it out.
// Not a C++ virtual call: this file's only OpResolverAbi is TableResolver,
// so the compiler may devirtualize such a call into TableResolver's.
const Registration* FindCustomOf(const void* resolver, const char* name,
                                 int version) {
  using FindOp = const Registration* (*)(const void*, const char*, int);
  const FindOp find = (*static_cast<FindOp* const*>(resolver))[1];
  return find(resolver, name, version);
}

// The triple of a std::vector<T*> as raw pointers (libstdc++'s layout:
// begin, end, end of storage).
bool LooksLikeVector(const void* at) {
  uintptr_t p[3];
  std::memcpy(p, at, sizeof(p));
  if (p[0] == 0) return p[1] == 0 && p[2] == 0;
  return p[0] % alignof(void*) == 0 && p[0] <= p[1] && p[1] <= p[2] &&
         (p[2] - p[0]) / sizeof(void*) < 4096 &&
         (p[1] - p[0]) % sizeof(void*) == 0;
}

}  // namespace

std::string ChainInto(void* mutable_op_resolver, const OpTable* table) {
  if (mutable_op_resolver == nullptr) return "the op resolver pointer is null";
  if (table->empty()) return "no ops to register";
  static_assert(sizeof(std::vector<const OpResolverAbi*>) == 3 * sizeof(void*),
                "std::vector is three pointers in libstdc++");
  auto* resolver = static_cast<MutableOpResolverAbi*>(mutable_op_resolver);
  const Registration* probe = table->front();
  if (FindCustomOf(resolver, probe->custom_name, probe->version) == probe) {
    return "";  // already chained into this resolver
  }
  if (!LooksLikeVector(&resolver->other_op_resolvers)) {
    return "this ai_edge_litert's MutableOpResolver does not have the layout "
           "tapehook was built for (its chained-resolver list is not where "
           "TFLite's declaration puts it)";
  }
  // One resolver per table for the life of the process: the interpreter
  // keeps pointers to the registrations it finds.
  static std::unordered_map<const OpTable*, std::unique_ptr<TableResolver>>
      resolvers;
  std::unique_ptr<TableResolver>& mine = resolvers[table];
  if (!mine) mine.reset(new TableResolver(table));
  resolver->other_op_resolvers.push_back(mine.get());
  if (FindCustomOf(resolver, probe->custom_name, probe->version) != probe) {
    resolver->other_op_resolvers.pop_back();
    return "this ai_edge_litert's op resolver did not find the ops after "
           "chaining (its FindOp is not where TFLite's declaration puts it)";
  }
  return "";
}

}  // namespace lite
}  // namespace tapehook
