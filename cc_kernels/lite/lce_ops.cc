// LCE's binary ops (LceQuantize, LceDequantize, LceBconv2d, LceBMaxPool2d)
// as LiteRT custom ops on the core's kernels (core/lce_bconv.h). The ops
// check every tensor a file gives them (types, ranks, sizes, constants) in
// prepare and report what is wrong through the interpreter, which raises it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "core/lce_bconv.h"
#include "core/plan.h"
#include "flex_map.h"
#include "resolver_hook.h"
#include "tflite_abi.h"
#include "thread_pool.h"

namespace tapehook {
namespace lite {

IntArray* NewIntArray(int size) {
  auto* a = static_cast<IntArray*>(
      std::malloc(sizeof(IntArray) + sizeof(int) * (size > 0 ? size : 0)));
  a->size = size;
  return a;
}

namespace {

using lce::PackedWords;

Status Fail(Context* context, const char* op, const std::string& message) {
  context->ReportError(context, "%s: %s", op, message.c_str());
  return kError;
}

// The node's i-th input or output tensor, or null (optional or out of range).
Tensor* TensorAt(Context* context, const IntArray* list, int i) {
  if (list == nullptr || i >= list->size) return nullptr;
  const int index = list->data[i];
  if (index < 0 || static_cast<size_t>(index) >= context->tensors_size) {
    return nullptr;
  }
  return &context->tensors[index];
}

int Rank(const Tensor* t) { return t->dims == nullptr ? -1 : t->dims->size; }
int64_t Dim(const Tensor* t, int i) { return t->dims->data[i]; }
int64_t Elements(const Tensor* t) {
  int64_t n = 1;
  for (int i = 0; i < Rank(t); ++i) n *= Dim(t, i);
  return n;
}

const char* TypeName(TensorType type) {
  switch (type) {
    case kFloat32:
      return "float32";
    case kInt32:
      return "int32";
    case kInt8:
      return "int8";
    case kBool:
      return "bool";
    case kUInt8:
      return "uint8";
    case kInt64:
      return "int64";
    default:
      return "another type";
  }
}

std::string Describe(const char* what, const Tensor* t) {
  std::string shape = "[";
  for (int i = 0; i < Rank(t); ++i) {
    shape += (i ? ", " : "") + std::to_string(Dim(t, i));
  }
  return std::string(what) + " (" + TypeName(t->type) + " " + shape + "]";
}

// Interpreters with the same thread count share one pool.
ThreadPool& PoolFor(const Context* context) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  const int threads = context->recommended_num_threads > 0
                          ? std::min(context->recommended_num_threads, 256)
                          : 1;
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<ThreadPool>& pool = pools[threads];
  if (!pool) pool.reset(new ThreadPool(threads));
  return *pool;
}

// The threads one op's eval shares its work on: its interpreter's pool, held
// busy for the eval (ThreadPool::Busy), as a core ParallelFor.
class OpThreads {
 public:
  explicit OpThreads(const Context* context)
      : pool_(PoolFor(context)), busy_(pool_), pf_(pool_.AsParallelFor()) {}
  const ParallelFor& parallel_for() const { return pf_; }

 private:
  ThreadPool& pool_;
  const ThreadPool::Busy busy_;
  const ParallelFor pf_;
};

// Checks the node has n_in inputs and 1 output; fills in / out.
std::string InputsAndOutput(Context* context, const Node* node, int n_in,
                            Tensor** in, Tensor** out) {
  if (node->inputs == nullptr || node->inputs->size != n_in ||
      node->outputs == nullptr || node->outputs->size != 1) {
    return "expected " + std::to_string(n_in) + " input(s) and 1 output";
  }
  for (int i = 0; i < n_in; ++i) in[i] = TensorAt(context, node->inputs, i);
  *out = TensorAt(context, node->outputs, 0);
  if (in[0] == nullptr || *out == nullptr || Rank(in[0]) < 1 ||
      Rank(*out) < 0) {
    return "its input or output tensor is missing";
  }
  for (int i = 0; i < Rank(in[0]); ++i) {
    if (Dim(in[0], i) < 0)
      return Describe("input", in[0]) + " has a negative size";
  }
  return "";
}

// ---------------------------------------------------------------- quantize

Status QuantizePrepare(Context* context, Node* node) {
  const char* op = "LceQuantize";
  Tensor *in, *out;
  std::string error = InputsAndOutput(context, node, 1, &in, &out);
  if (!error.empty()) return Fail(context, op, error);
  if (in->type != kFloat32 && in->type != kInt8 && in->type != kBool) {
    return Fail(context, op,
                Describe("input", in) + " must be float32, int8 or bool");
  }
  if (out->type != kInt32) {
    return Fail(context, op, Describe("output", out) + " must be int32");
  }
  IntArray* dims = NewIntArray(Rank(in));
  for (int i = 0; i < Rank(in); ++i) dims->data[i] = in->dims->data[i];
  dims->data[Rank(in) - 1] =
      static_cast<int>(PackedWords(Dim(in, Rank(in) - 1)));
  return context->ResizeTensor(context, out, dims);
}

// The rows and channels (last axis) of t's unpacked form.
void RowsAndChannels(const Tensor* t, int64_t* rows, int64_t* channels) {
  *channels = Dim(t, Rank(t) - 1);
  *rows = *channels > 0 ? Elements(t) / *channels : 0;
}

Status QuantizeEval(Context* context, Node* node) {
  Tensor* in = TensorAt(context, node->inputs, 0);
  Tensor* out = TensorAt(context, node->outputs, 0);
  int64_t rows, channels;
  RowsAndChannels(in, &rows, &channels);
  // Also wakes the pool for the binary conv that usually follows.
  const OpThreads threads(context);
  const ParallelFor& pf = threads.parallel_for();
  auto* words = static_cast<int32_t*>(out->data);
  if (in->type == kFloat32) {
    lce::PackSigns(static_cast<const float*>(in->data), rows, channels, words,
                   pf);
  } else if (in->type == kInt8) {
    lce::PackSignsInt8(static_cast<const int8_t*>(in->data), rows, channels,
                       in->params.zero_point, words, pf);
  } else {
    // false (all bits 0) packs as bit 1, true as bit 0: values below 1.
    lce::PackSignsInt8(static_cast<const int8_t*>(in->data), rows, channels, 1,
                       words, pf);
  }
  return kOk;
}

// -------------------------------------------------------------- dequantize

Status DequantizePrepare(Context* context, Node* node) {
  const char* op = "LceDequantize";
  Tensor *in, *out;
  std::string error = InputsAndOutput(context, node, 1, &in, &out);
  if (!error.empty()) return Fail(context, op, error);
  if (in->type != kInt32) {
    return Fail(context, op, Describe("input", in) + " must be int32");
  }
  if (out->type != kFloat32 && out->type != kInt8 && out->type != kBool) {
    return Fail(context, op,
                Describe("output", out) + " must be float32, int8 or bool");
  }
  bool fits = Rank(in) == Rank(out) &&
              PackedWords(Dim(out, Rank(out) - 1)) == Dim(in, Rank(in) - 1);
  for (int i = 0; fits && i < Rank(in) - 1; ++i) {
    fits = Dim(in, i) == Dim(out, i);
  }
  if (!fits) {
    return Fail(context, op,
                Describe("input", in) + " is not the bitpacked form of " +
                    Describe("output", out));
  }
  if (out->type == kInt8 && !(out->params.scale > 0)) {
    return Fail(context, op, "int8 output needs a positive scale");
  }
  return kOk;
}

Status DequantizeEval(Context* context, Node* node) {
  Tensor* in = TensorAt(context, node->inputs, 0);
  Tensor* out = TensorAt(context, node->outputs, 0);
  int64_t rows, channels;
  RowsAndChannels(out, &rows, &channels);
  const OpThreads threads(context);
  const ParallelFor& pf = threads.parallel_for();
  const auto* words = static_cast<const int32_t*>(in->data);
  if (out->type == kFloat32) {
    lce::UnpackSigns(words, rows, channels, static_cast<float*>(out->data), pf);
  } else if (out->type == kInt8) {
    // +1 and -1 quantized, as LCE writes them.
    const int offset = static_cast<int>(std::round(1.0f / out->params.scale));
    const int8_t zero_bit =
        static_cast<int8_t>(std::min(127, out->params.zero_point + offset));
    const int8_t one_bit =
        static_cast<int8_t>(std::max(-128, out->params.zero_point - offset));
    lce::UnpackSignsInt8(words, rows, channels, zero_bit, one_bit,
                         static_cast<int8_t*>(out->data), pf);
  } else {
    lce::UnpackSignsInt8(words, rows, channels, 1, 0,
                         static_cast<int8_t*>(out->data), pf);
  }
  return kOk;
}

// ------------------------------------------------------------------ bconv

struct BConvData {
  std::string error;  // from the custom options
  lce::BConvAttrs attrs;
  lce::BConv2D conv;
  // Elementwise ops after the conv that tapehook.lite took into it as it
  // loaded the file (lite_fuse.py): their operands are inputs 5, 6, ...
  std::vector<lce::EpilogueStep> steps;
};

// tapehook.lite's own options for those steps: "tapehook_epilogue_steps"
// (how many, at most kMaxSteps) and "tapehook_epilogue", 6 bits a step from
// bit 0: the op (0 operand - v, 1 v - operand, 2 v * operand, 3 v +
// operand), then TFLite's fused activation code (0 to 3) shifted by 3.
constexpr int64_t kMaxSteps = 8;

// Reads the options every LCE op shares; "" or the error.
std::string ReadInts(
    const char* buffer, size_t length,
    std::initializer_list<std::pair<const char*, int64_t*>> fields) {
  FlexMap map;
  std::string error =
      map.Parse(reinterpret_cast<const uint8_t*>(buffer), length);
  if (!error.empty()) return error;
  for (const auto& field : fields) {
    if (!map.Get(field.first, field.second)) {
      return std::string("its custom options lack the integer '") +
             field.first + "'";
    }
  }
  return "";
}

void* BConvInit(Context*, const char* buffer, size_t length) {
  auto* data = new BConvData;
  int64_t stride_h, stride_w, dil_h, dil_w, padding, pad_values, channels_in,
      activation;
  data->error = ReadInts(buffer, length,
                         {{"stride_height", &stride_h},
                          {"stride_width", &stride_w},
                          {"dilation_height_factor", &dil_h},
                          {"dilation_width_factor", &dil_w},
                          {"padding", &padding},
                          {"pad_values", &pad_values},
                          {"channels_in", &channels_in},
                          {"fused_activation_function", &activation}});
  if (!data->error.empty()) return data;
  const auto in_range = [](int64_t v, int64_t lo, int64_t hi) {
    return v >= lo && v <= hi;
  };
  if (!in_range(stride_h, 1, 1 << 16) || !in_range(stride_w, 1, 1 << 16) ||
      !in_range(dil_h, 1, 1 << 16) || !in_range(dil_w, 1, 1 << 16)) {
    data->error = "strides and dilations must be between 1 and 65536";
  } else if (padding != 0 && padding != 1) {
    data->error = "padding must be SAME (0) or VALID (1)";
  } else if (pad_values != 0 && pad_values != 1) {
    data->error = "pad_values must be 0 or 1";
  } else if (!in_range(channels_in, 1, 1 << 24)) {
    data->error = "channels_in must be between 1 and 2^24";
  } else if (!in_range(activation, 0, 3)) {
    data->error =
        "fused_activation_function must be NONE, RELU, RELU_N1_TO_1 or "
        "RELU6";
  }
  FlexMap map;
  int64_t n = 0, packed = 0;
  if (map.Parse(reinterpret_cast<const uint8_t*>(buffer), length).empty() &&
      map.Get("tapehook_epilogue_steps", &n)) {
    if (!in_range(n, 0, kMaxSteps) || !map.Get("tapehook_epilogue", &packed) ||
        packed < 0) {
      if (data->error.empty()) {
        data->error =
            "tapehook_epilogue_steps must be 0 to 8, with a "
            "tapehook_epilogue of its steps";
      }
      n = 0;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t code = packed >> (6 * i) & 63;
      const int64_t act = code >> 3;
      lce::EpilogueStep step;
      step.op = static_cast<lce::EpilogueStep::Op>(code & 3);
      if ((code & 4) != 0 || act > 3) {
        if (data->error.empty()) data->error = "a bad tapehook_epilogue step";
      }
      if (act == 1 || act == 3) step.lo = 0.0f;
      if (act == 2) step.lo = -1.0f, step.hi = 1.0f;
      if (act == 3) step.hi = 6.0f;
      data->steps.push_back(step);
    }
  }
  lce::BConvAttrs& a = data->attrs;
  a.stride_h = stride_h, a.stride_w = stride_w;
  a.dil_h = dil_h, a.dil_w = dil_w;
  a.same = padding == 0;
  a.pad_value = static_cast<int>(pad_values);
  a.channels_in = channels_in;
  a.activation = static_cast<lce::Activation>(activation);
  return data;
}

void BConvFree(Context*, void* buffer) {
  delete static_cast<BConvData*>(buffer);
}

bool IsConstant(const Tensor* t) {
  return t != nullptr && t->allocation_type == kMmapRo && t->data != nullptr;
}

// A constant 1-D tensor of n values of `type`.
bool IsVector(const Tensor* t, TensorType type, int64_t n) {
  return IsConstant(t) && t->type == type && Rank(t) == 1 && Dim(t, 0) == n &&
         t->bytes >= static_cast<size_t>(n) * 4;
}

Status BConvPrepare(Context* context, Node* node) {
  const char* op = "LceBconv2d";
  auto* data = static_cast<BConvData*>(node->user_data);
  if (data == nullptr) return Fail(context, op, "no node data");
  if (!data->error.empty()) return Fail(context, op, data->error);
  const int n_in = 5 + static_cast<int>(data->steps.size());
  Tensor* in[5 + kMaxSteps] = {};
  Tensor* out;
  std::string error = InputsAndOutput(context, node, n_in, in, &out);
  if (!error.empty()) return Fail(context, op, error);
  Tensor* input = in[0];
  Tensor* filter = in[1];
  if (input->type != kInt32 || Rank(input) != 4) {
    return Fail(context, op,
                Describe("input", input) + " must be 4-D int32 (bitpacked)");
  }
  if (filter == nullptr || filter->type != kInt32 || Rank(filter) != 4 ||
      !IsConstant(filter) ||
      filter->bytes < static_cast<size_t>(Elements(filter)) * 4) {
    return Fail(context, op,
                "the filter must be a constant 4-D int32 tensor (bitpacked "
                "OHWI)");
  }
  lce::OutputKind kind;
  if (out->type == kFloat32) {
    kind = lce::OutputKind::kFloat;
  } else if (out->type == kInt8) {
    kind = lce::OutputKind::kInt8;
  } else if (out->type == kInt32) {
    kind = lce::OutputKind::kBitpacked;
  } else {
    return Fail(context, op,
                Describe("output", out) + " must be float32, int8 or int32");
  }
  const int64_t N = Dim(filter, 0);
  const float* post_mul = nullptr;
  const float* post_bias = nullptr;
  const int32_t* thresholds = nullptr;
  if (kind == lce::OutputKind::kBitpacked) {
    if (!IsVector(in[4], kInt32, N)) {
      return Fail(context, op,
                  "bitpacked output needs constant int32 thresholds of one "
                  "value per output channel (" +
                      std::to_string(N) + ")");
    }
    thresholds = static_cast<const int32_t*>(in[4]->data);
  } else {
    if (!IsVector(in[2], kFloat32, N) || !IsVector(in[3], kFloat32, N)) {
      return Fail(context, op,
                  "the post-activation multiplier and bias must be constant "
                  "float32 vectors of one value per output channel (" +
                      std::to_string(N) + ")");
    }
    post_mul = static_cast<const float*>(in[2]->data);
    post_bias = static_cast<const float*>(in[3]->data);
  }
  if (kind == lce::OutputKind::kInt8 && !(out->params.scale > 0)) {
    return Fail(context, op, "int8 output needs a positive scale");
  }
  const int64_t filter_dims[4] = {Dim(filter, 0), Dim(filter, 1),
                                  Dim(filter, 2), Dim(filter, 3)};
  try {
    error = data->conv.Prepare(data->attrs, kind, Dim(input, 0), Dim(input, 1),
                               Dim(input, 2), Dim(input, 3), filter_dims,
                               static_cast<const int32_t*>(filter->data),
                               post_mul, post_bias, thresholds,
                               out->params.scale, out->params.zero_point);
  } catch (const std::exception& exc) {  // its buffers did not fit in memory
    error = std::string("preparing failed: ") + exc.what();
  }
  if (!error.empty()) {
    return Fail(context, op,
                error + "; " + Describe("input", input) + ", " +
                    Describe("filter", filter));
  }
  const int64_t out_dims[4] = {Dim(input, 0), data->conv.out_h(),
                               data->conv.out_w(), data->conv.out_channels()};
  for (size_t i = 0; i < data->steps.size(); ++i) {
    // One value, one per output channel, or the output's shape.
    const Tensor* a = in[5 + i];
    using Operand = lce::EpilogueStep::Operand;
    bool full = a != nullptr && Rank(a) == 4;
    for (int d = 0; full && d < 4; ++d) full = Dim(a, d) == out_dims[d];
    const bool ok = a != nullptr && a->type == kFloat32 && Rank(a) >= 0 &&
                    a->bytes >= static_cast<size_t>(Elements(a)) * 4 &&
                    (Elements(a) == 1 || full ||
                     (Rank(a) >= 1 && Elements(a) == out_dims[3] &&
                      Dim(a, Rank(a) - 1) == out_dims[3]));
    if (kind != lce::OutputKind::kFloat || !ok) {
      return Fail(context, op,
                  "an epilogue operand (input " + std::to_string(5 + i) +
                      ") needs float output and a float32 tensor of one "
                      "value, one per output channel or the output's shape; " +
                      (a != nullptr ? Describe("operand", a)
                                    : std::string("it is missing")));
    }
    data->steps[i].operand = full               ? Operand::kFull
                             : Elements(a) == 1 ? Operand::kScalar
                                                : Operand::kChannel;
  }
  IntArray* dims = NewIntArray(4);
  for (int i = 0; i < 4; ++i) dims->data[i] = static_cast<int>(out_dims[i]);
  return context->ResizeTensor(context, out, dims);
}

Status BConvEval(Context* context, Node* node) {
  auto* data = static_cast<BConvData*>(node->user_data);
  Tensor* input = TensorAt(context, node->inputs, 0);
  Tensor* out = TensorAt(context, node->outputs, 0);
  for (size_t i = 0; i < data->steps.size(); ++i) {
    data->steps[i].values = static_cast<const float*>(
        TensorAt(context, node->inputs, static_cast<int>(5 + i))->data);
  }
  const OpThreads threads(context);
  data->conv.Run(static_cast<const int32_t*>(input->data), out->data,
                 threads.parallel_for(),
                 data->steps.empty() ? nullptr : &data->steps);
  return kOk;
}

// ---------------------------------------------------------------- maxpool

struct PoolData {
  std::string error;
  int64_t k_h = 0, k_w = 0, stride_h = 0, stride_w = 0;
  bool same = false;
};

void* PoolInit(Context*, const char* buffer, size_t length) {
  auto* data = new PoolData;
  int64_t padding;
  data->error = ReadInts(buffer, length,
                         {{"filter_height", &data->k_h},
                          {"filter_width", &data->k_w},
                          {"stride_height", &data->stride_h},
                          {"stride_width", &data->stride_w},
                          {"padding", &padding}});
  if (!data->error.empty()) return data;
  if (data->k_h < 1 || data->k_w < 1 || data->stride_h < 1 ||
      data->stride_w < 1 || data->k_h > (1 << 16) || data->k_w > (1 << 16) ||
      data->stride_h > (1 << 16) || data->stride_w > (1 << 16)) {
    data->error = "filter sizes and strides must be between 1 and 65536";
  } else if (padding != 0 && padding != 1) {
    data->error = "padding must be SAME (0) or VALID (1)";
  }
  data->same = padding == 0;
  return data;
}

void PoolFree(Context*, void* buffer) { delete static_cast<PoolData*>(buffer); }

Status PoolPrepare(Context* context, Node* node) {
  const char* op = "LceBMaxPool2d";
  auto* data = static_cast<PoolData*>(node->user_data);
  if (data == nullptr) return Fail(context, op, "no node data");
  if (!data->error.empty()) return Fail(context, op, data->error);
  Tensor *in, *out;
  std::string error = InputsAndOutput(context, node, 1, &in, &out);
  if (!error.empty()) return Fail(context, op, error);
  if (in->type != kInt32 || Rank(in) != 4 || out->type != kInt32) {
    return Fail(context, op,
                Describe("input", in) + " and " + Describe("output", out) +
                    " must be 4-D int32 (bitpacked)");
  }
  int64_t out_h, out_w;
  error = lce::BMaxPoolGeometry(Dim(in, 1), Dim(in, 2), data->k_h, data->k_w,
                                data->stride_h, data->stride_w, data->same,
                                &out_h, &out_w);
  if (!error.empty()) return Fail(context, op, error);
  IntArray* dims = NewIntArray(4);
  dims->data[0] = static_cast<int>(Dim(in, 0));
  dims->data[1] = static_cast<int>(out_h);
  dims->data[2] = static_cast<int>(out_w);
  dims->data[3] = static_cast<int>(Dim(in, 3));
  return context->ResizeTensor(context, out, dims);
}

Status PoolEval(Context* context, Node* node) {
  auto* data = static_cast<PoolData*>(node->user_data);
  Tensor* in = TensorAt(context, node->inputs, 0);
  Tensor* out = TensorAt(context, node->outputs, 0);
  const OpThreads threads(context);
  lce::BMaxPool(static_cast<const int32_t*>(in->data), Dim(in, 0), Dim(in, 1),
                Dim(in, 2), Dim(in, 3), data->k_h, data->k_w, data->stride_h,
                data->stride_w, data->same, static_cast<int32_t*>(out->data),
                threads.parallel_for());
  return kOk;
}

Registration MakeRegistration(const char* name,
                              void* (*init)(Context*, const char*, size_t),
                              void (*free)(Context*, void*),
                              Status (*prepare)(Context*, Node*),
                              Status (*invoke)(Context*, Node*)) {
  Registration r{};
  r.init = init;
  r.free = free;
  r.prepare = prepare;
  r.invoke = invoke;
  r.builtin_code = kBuiltinCustom;
  r.custom_name = name;
  r.version = 1;
  return r;
}

const OpTable* LceOps() {
  static const Registration quantize = MakeRegistration(
      "LceQuantize", nullptr, nullptr, QuantizePrepare, QuantizeEval);
  static const Registration dequantize = MakeRegistration(
      "LceDequantize", nullptr, nullptr, DequantizePrepare, DequantizeEval);
  static const Registration bconv = MakeRegistration(
      "LceBconv2d", BConvInit, BConvFree, BConvPrepare, BConvEval);
  static const Registration bmaxpool = MakeRegistration(
      "LceBMaxPool2d", PoolInit, PoolFree, PoolPrepare, PoolEval);
  static const OpTable table = {&quantize, &dequantize, &bconv, &bmaxpool};
  return &table;
}

}  // namespace
}  // namespace lite
}  // namespace tapehook

extern "C" {

// Registers LCE's ops into the tflite::MutableOpResolver at `resolver`.
// Returns 0, or 1 with the reason in error[0, error_size).
__attribute__((visibility("default"))) int tapehook_lite_register(
    void* resolver, char* error, size_t error_size) {
  const std::string message =
      tapehook::lite::ChainInto(resolver, tapehook::lite::LceOps());
  if (error != nullptr && error_size > 0) {
    std::snprintf(error, error_size, "%s", message.c_str());
  }
  return message.empty() ? 0 : 1;
}

// The same as a registerer by symbol name for
// InterpreterWithCustomOps(custom_op_registerers=["TapehookLiteRegisterLceOps"])
// once this library is loaded with RTLD_GLOBAL.
__attribute__((visibility("default"))) void TapehookLiteRegisterLceOps(
    void* resolver) {
  tapehook_lite_register(resolver, nullptr, 0);
}

// The implementation (plan.h's name: "avx512", "avx2", "portable") that
// LceBconv2d runs on this CPU under the TAPEHOOK_NO_* switches in effect.
__attribute__((visibility("default"))) const char* tapehook_lite_impl() {
  tapehook::ConvShape s;
  s.batch = s.in_h = s.in_w = s.k_h = s.k_w = s.out_h = s.out_w = 1;
  s.in_c = s.out_c = 64;
  return tapehook::ImplName(tapehook::RunnableOrBest(
      tapehook::QueryOf(tapehook::ConvOp::kForward, s, true, false, false),
      tapehook::Impl::kBest));
}

}  // extern "C"
