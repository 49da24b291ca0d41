// Registering custom ops into ai_edge_litert's op resolver without its
// (hidden) C++ symbols; see resolver_hook.cc.
#ifndef TAPEHOOK_LITE_RESOLVER_HOOK_H_
#define TAPEHOOK_LITE_RESOLVER_HOOK_H_

#include <string>
#include <vector>

#include "tflite_abi.h"

namespace tapehook {
namespace lite {

// Registrations with custom_name set; they must outlive the process's
// interpreters.
using OpTable = std::vector<const Registration*>;

// Makes the tflite::MutableOpResolver at mutable_op_resolver find the ops of
// `table` by name. Returns "" or why it could not.
std::string ChainInto(void* mutable_op_resolver, const OpTable* table);

}  // namespace lite
}  // namespace tapehook

#endif  // TAPEHOOK_LITE_RESOLVER_HOOK_H_
