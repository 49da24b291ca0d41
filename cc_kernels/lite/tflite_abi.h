// The parts of TensorFlow Lite's C ABI (tflite/core/c/common.h) that a custom
// op needs, declared here because no installed package ships the headers:
// ai_edge_litert hides every TFLite symbol, so only these plain C structs
// (whose layout TFLite keeps stable, growing them only at the end) and the
// function pointers inside them cross the boundary. Fields this library never
// reads are kept as opaque members of the same size, in the same place.
#ifndef TAPEHOOK_LITE_TFLITE_ABI_H_
#define TAPEHOOK_LITE_TFLITE_ABI_H_

#include <cstddef>
#include <cstdint>

namespace tapehook {
namespace lite {

enum Status : int { kOk = 0, kError = 1 };

enum TensorType : int {
  kNoType = 0,
  kFloat32 = 1,
  kInt32 = 2,
  kUInt8 = 3,
  kInt64 = 4,
  kBool = 6,
  kInt8 = 9,
};

enum AllocationType : int { kMmapRo = 1, kArenaRw = 2, kDynamic = 4 };

struct IntArray {
  int size;
  int data[];
};

struct QuantizationParams {
  float scale;
  int32_t zero_point;
};

struct Quantization {
  int type;
  void* params;
};

struct Tensor {
  TensorType type;
  void* data;
  IntArray* dims;
  QuantizationParams params;
  AllocationType allocation_type;
  size_t bytes;
  const void* allocation;
  const char* name;
  void* delegate;
  int buffer_handle;
  bool data_is_stale;
  bool is_variable;
  Quantization quantization;
  void* sparsity;
  const IntArray* dims_signature;
};

struct Node {
  IntArray* inputs;
  IntArray* outputs;
  IntArray* intermediates;
  IntArray* temporaries;
  void* user_data;
  void* builtin_data;
  const void* custom_initial_data;
  int custom_initial_data_size;
  void* delegate;
  bool might_have_side_effect;
};

struct Context {
  size_t tensors_size;
  void* get_execution_plan;
  Tensor* tensors;
  void* impl_;
  Status (*ResizeTensor)(Context*, Tensor* tensor, IntArray* new_size);
  void (*ReportError)(Context*, const char* format, ...);
  void* add_tensors;
  void* get_node_and_registration;
  void* replace_node_subsets_with_delegate_kernels;
  int recommended_num_threads;
  // Later members (external contexts, arena buffers, GetTensor, ...) are
  // never read here.
};

// Members past `version` (registration_external, async_kernel,
// inplace_operator and any a later TFLite appends) must read as zero: the
// interpreter copies the whole struct, so `reserved` leaves room for growth.
struct Registration {
  void* (*init)(Context* context, const char* buffer, size_t length);
  void (*free)(Context* context, void* buffer);
  Status (*prepare)(Context* context, Node* node);
  Status (*invoke)(Context* context, Node* node);
  const char* (*profiling_string)(const Context* context, const Node* node);
  int32_t builtin_code;
  const char* custom_name;
  int version;
  void* reserved[16];
};

// BuiltinOperator_CUSTOM in TFLite's schema.
constexpr int32_t kBuiltinCustom = 32;

// A new IntArray of `size` entries, freed by TFLite with free() (as its own
// TfLiteIntArrayCreate allocates it), so it must come from malloc.
IntArray* NewIntArray(int size);

}  // namespace lite
}  // namespace tapehook

#endif  // TAPEHOOK_LITE_TFLITE_ABI_H_
