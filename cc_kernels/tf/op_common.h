// What the op families' TF wrappers share: TF's op headers and names, the
// widening of half and bfloat16 tensors to the core's compute type, and the
// shape of an input kept as packed bits.
#ifndef TAPEHOOK_TF_OP_COMMON_H_
#define TAPEHOOK_TF_OP_COMMON_H_

#include <cstdint>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tapehook {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
namespace shape_inference = ::tensorflow::shape_inference;
namespace errors = ::tensorflow::errors;

// The core computes in float or double; half and bfloat16 are widened to
// float on the way in and rounded on the way out.
template <typename T>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

template <typename T>
class Widened {
 public:
  using C = typename Compute<T>::type;
  explicit Widened(const Tensor& t) {
    if constexpr (std::is_same_v<T, C>) {
      ptr_ = t.flat<T>().data();
    } else {
      auto f = t.flat<T>();
      buf_.resize(f.size());
      for (int64_t i = 0; i < f.size(); ++i) buf_[i] = static_cast<C>(f(i));
      ptr_ = buf_.data();
    }
  }
  const C* data() const { return ptr_; }

 private:
  std::vector<C> buf_;
  const C* ptr_ = nullptr;
};

// Output buffer in compute precision; Store() rounds into the TF tensor.
template <typename T>
class WidenedOut {
 public:
  using C = typename Compute<T>::type;
  explicit WidenedOut(Tensor* t) : t_(t) {
    if constexpr (std::is_same_v<T, C>) {
      ptr_ = t->flat<T>().data();
    } else {
      buf_.resize(t->NumElements());
      ptr_ = buf_.data();
    }
  }
  C* data() { return ptr_; }
  void Store() {
    if constexpr (!std::is_same_v<T, C>) {
      auto f = t_->flat<T>();
      for (int64_t i = 0; i < f.size(); ++i) f(i) = static_cast<T>(buf_[i]);
    }
  }

 private:
  Tensor* t_;
  std::vector<C> buf_;
  C* ptr_ = nullptr;
};

// Input 0 (packed bits) with its last dimension replaced by the `channels`
// attr: the shape of the unpacked input. Input 0 has rank `rank`, or any
// rank >= 1 when rank is 0.
inline absl::Status UnpackedShape(
    ::tensorflow::shape_inference::InferenceContext* c, int rank,
    ::tensorflow::shape_inference::ShapeHandle* out) {
  int64_t channels;
  TF_RETURN_IF_ERROR(c->GetAttr("channels", &channels));
  ::tensorflow::shape_inference::ShapeHandle in = c->input(0), prefix;
  TF_RETURN_IF_ERROR(rank > 0 ? c->WithRank(in, rank, &in)
                              : c->WithRankAtLeast(in, 1, &in));
  TF_RETURN_IF_ERROR(c->Subshape(in, 0, -1, &prefix));
  return c->Concatenate(prefix, c->Vector(channels), out);
}

}  // namespace tapehook

#endif  // TAPEHOOK_TF_OP_COMMON_H_
