// Thin TensorFlow wrappers around cc_kernels/core/pack_input.h and
// estimator.h: what a binary-activation conv's backward keeps of its input
// (packed sign / mask bits, a 16-bit e'(x)) and the ops that read it back.
#include <string>
#include <type_traits>
#include <vector>

#include "core/estimator.h"
#include "core/pack_input.h"
#include "tf/conv_attrs.h"
#include "tf/op_common.h"
#include "tf/thread_pool.h"

namespace tapehook {
namespace {

// The ops that keep an input's bits or derivative take an optional
// per-channel threshold, last (a list of zero or one [channels] tensors):
// they keep those of input - threshold, RSign's shift (tapehook/conv2d.py).
REGISTER_OP("TapehookPackInput")
    .Input("input: T")
    .Input("threshold: num_threshold * T")
    .Output("packed: uint8")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("num_threshold: int >= 0 = 0")
    .Attr("clip: float = 1.0")
    .Attr("clip_f64_bits: int = 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle in = c->input(0), prefix, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(in, 1, &in));
      TF_RETURN_IF_ERROR(c->Subshape(in, 0, -1, &prefix));
      shape_inference::DimensionHandle channels = c->Dim(in, -1);
      shape_inference::DimensionHandle bytes =
          c->ValueKnown(channels) ? c->MakeDim(PackedBytes(c->Value(channels)))
                                  : c->UnknownDim();
      TF_RETURN_IF_ERROR(c->Concatenate(prefix, c->Vector(bytes), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(
        "Sign and ste_sign mask bits of a binary conv's input "
        "(core/pack_input.h).");

REGISTER_OP("TapehookUnpackInput")
    .Input("packed: uint8")
    .Output("x_hat: T")
    .Output("mask: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("channels: int")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(UnpackedShape(c, /*rank=*/0, &out));
      c->set_output(0, out);
      c->set_output(1, out);
      return absl::OkStatus();
    });

// Refuses a threshold where the op cannot take one: more than one, or a
// dtype the kernels do not compute in directly (half, bfloat16).
template <typename T>
absl::Status CheckThresholdCount(OpKernelConstruction* ctx, int* count) {
  TF_RETURN_IF_ERROR(ctx->GetAttr("num_threshold", count));
  if (*count > 1 || (*count == 1 && !std::is_same_v<T, float> &&
                     !std::is_same_v<T, double>)) {
    return absl::InvalidArgumentError(
        ctx->def().op() +
        ": a threshold (at most one) needs float32 or float64");
  }
  return absl::OkStatus();
}

// The threshold input (the last) where `count` is 1, checked against the
// input's channels; null where there is none.
template <typename T>
absl::Status ThresholdInput(OpKernelContext* ctx, int count, int64_t channels,
                            const T** threshold) {
  *threshold = nullptr;
  if (count == 0) return absl::OkStatus();
  const Tensor& t = ctx->input(ctx->num_inputs() - 1);
  if (t.dims() != 1 || t.dim_size(0) != channels) {
    return absl::InvalidArgumentError(
        ctx->op_kernel().def().op() + ": threshold must be [channels] = [" +
        std::to_string(channels) + "]; got " + t.shape().DebugString());
  }
  *threshold = t.flat<T>().data();
  return absl::OkStatus();
}

template <typename T>
class PackInputOp : public OpKernel {
 public:
  explicit PackInputOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseClip(ctx, &clip_, &clip_f64_));
    OP_REQUIRES_OK(ctx, CheckThresholdCount<T>(ctx, &num_threshold_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() >= 1,
                errors::InvalidArgument("input must have a channel axis"));
    const int64_t channels = x.dim_size(x.dims() - 1);
    const T* threshold = nullptr;
    OP_REQUIRES_OK(ctx,
                   ThresholdInput(ctx, num_threshold_, channels, &threshold));
    TensorShape shape = x.shape();
    shape.set_dim(x.dims() - 1, PackedBytes(channels));
    Tensor* packed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &packed));
    if (x.NumElements() == 0) return;
    Widened<T> xw(x);
    using C = typename Compute<T>::type;
    const C* shift = nullptr;
    if constexpr (std::is_same_v<C, T>) shift = threshold;
    PackSignMask(xw.data(), x.NumElements() / channels, channels,
                 std::is_same_v<C, double> ? clip_f64_ : double{clip_},
                 packed->flat<uint8_t>().data(), ThreadPoolOf(ctx), shift);
  }

 private:
  float clip_;
  double clip_f64_;
  int num_threshold_ = 0;
};

template <typename T>
class UnpackInputOp : public OpKernel {
 public:
  explicit UnpackInputOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channels", &channels_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    OP_REQUIRES(ctx,
                packed.dims() >= 1 && packed.dim_size(packed.dims() - 1) ==
                                          PackedBytes(channels_),
                errors::InvalidArgument("packed input does not hold ",
                                        channels_, " channels"));
    TensorShape shape = packed.shape();
    shape.set_dim(packed.dims() - 1, channels_);
    Tensor *x_hat = nullptr, *mask = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &x_hat));
    // A graph whose only reader takes the signs (a batch norm's rebuild of
    // the conv output, conv2d.recompute_output) leaves the mask unread: the
    // executor then does not require it, and it is neither allocated nor
    // written (a full-size tensor per rebuilt conv).
    const bool with_mask = ctx->output_required(1);
    if (with_mask) {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, shape, &mask));
    }
    if (x_hat->NumElements() == 0) return;
    WidenedOut<T> xo(x_hat);
    std::optional<WidenedOut<T>> mo;
    if (with_mask) mo.emplace(mask);
    UnpackSignMask(packed.flat<uint8_t>().data(),
                   x_hat->NumElements() / channels_, channels_, xo.data(),
                   with_mask ? mo->data() : nullptr, ThreadPoolOf(ctx));
    xo.Store();
    if (with_mask) mo->Store();
  }

 private:
  int64_t channels_;
};

REGISTER_OP("TapehookEstimatorGradHalf")
    .Input("input: float")
    .Input("threshold: num_threshold * float")
    .Output("derivative: half")
    .Attr("activation_estimator: {'approx_sign', 'swish_sign'}")
    .Attr("num_threshold: int >= 0 = 0")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(
        "e'(x) of a continuous input estimator in binary16, rounded to "
        "nearest even: what a binary conv's backward keeps of a float32 "
        "input beside its sign bits (core/pack_input.h).");

REGISTER_OP("TapehookScaleByHalf")
    .Input("grad: float")
    .Input("derivative: half")
    .Output("output: float")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc("grad * derivative, the binary16 e'(x) widened exactly.");

REGISTER_OP("TapehookEstimatorGradFixed")
    .Input("input: float")
    .Input("threshold: num_threshold * float")
    .Output("derivative: uint16")
    .Attr("activation_estimator: {'approx_sign', 'swish_sign'}")
    .Attr("num_threshold: int >= 0 = 0")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(
        "e'(x) of a continuous input estimator in 16-bit fixed point over its "
        "range (core/pack_input.h, FixedDerivative): what a binary conv's "
        "backward keeps of a float32 input beside its sign bits by default.");

REGISTER_OP("TapehookScaleByFixed")
    .Input("grad: float")
    .Input("derivative: uint16")
    .Output("output: float")
    .Attr("activation_estimator: {'approx_sign', 'swish_sign'}")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc("grad * e'(x), e'(x) from TapehookEstimatorGradFixed's fixed point.");

// The two 16-bit forms of a continuous estimator's e'(x) (core/pack_input.h):
// binary16 (an Eigen::half tensor) or, kFixed, fixed point (a uint16 tensor);
// the core functions read either as uint16_t.
template <bool kFixed>
using Stored16 = std::conditional_t<kFixed, uint16_t, Eigen::half>;

template <bool kFixed>
class EstimatorGrad16Op : public OpKernel {
 public:
  explicit EstimatorGrad16Op(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string name;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation_estimator", &name));
    OP_REQUIRES(ctx, ParseEstimator(name, &estimator_),
                errors::InvalidArgument("unknown estimator ", name));
    OP_REQUIRES_OK(ctx, CheckThresholdCount<float>(ctx, &num_threshold_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const int64_t channels = x.dims() > 0 ? x.dim_size(x.dims() - 1) : 1;
    const float* threshold = nullptr;
    OP_REQUIRES_OK(ctx,
                   ThresholdInput(ctx, num_threshold_, channels, &threshold));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &out));
    if (x.NumElements() == 0) return;
    auto* bits =
        reinterpret_cast<uint16_t*>(out->flat<Stored16<kFixed>>().data());
    (kFixed ? EstimatorGradFixed : EstimatorGradHalf)(
        x.flat<float>().data(), x.NumElements(), estimator_, bits,
        ThreadPoolOf(ctx), threshold, channels);
  }

 private:
  Estimator estimator_;
  int num_threshold_ = 0;
};

template <bool kFixed>
class ScaleBy16Op : public OpKernel {
 public:
  explicit ScaleBy16Op(OpKernelConstruction* ctx) : OpKernel(ctx) {
    if (!kFixed) return;  // binary16 needs no estimator
    std::string name;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation_estimator", &name));
    OP_REQUIRES(ctx, ParseEstimator(name, &estimator_),
                errors::InvalidArgument("unknown estimator ", name));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor &grad = ctx->input(0), &derivative = ctx->input(1);
    OP_REQUIRES(ctx, grad.shape() == derivative.shape(),
                errors::InvalidArgument(
                    "grad ", grad.shape().DebugString(), " and derivative ",
                    derivative.shape().DebugString(), " differ in shape"));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(
        ctx, ctx->forward_input_or_allocate_output({0}, 0, grad.shape(), &out));
    if (grad.NumElements() == 0) return;
    const auto* bits = reinterpret_cast<const uint16_t*>(
        derivative.flat<Stored16<kFixed>>().data());
    const float* in = grad.flat<float>().data();
    float* result = out->flat<float>().data();
    if (kFixed) {
      ScaleByFixed(in, bits, grad.NumElements(), estimator_, result,
                   ThreadPoolOf(ctx));
    } else {
      ScaleByHalf(in, bits, grad.NumElements(), result, ThreadPoolOf(ctx));
    }
  }

 private:
  Estimator estimator_ = Estimator::kNone;
};

REGISTER_KERNEL_BUILDER(Name("TapehookEstimatorGradHalf").Device(DEVICE_CPU),
                        EstimatorGrad16Op<false>);
REGISTER_KERNEL_BUILDER(Name("TapehookScaleByHalf").Device(DEVICE_CPU),
                        ScaleBy16Op<false>);
REGISTER_KERNEL_BUILDER(Name("TapehookEstimatorGradFixed").Device(DEVICE_CPU),
                        EstimatorGrad16Op<true>);
REGISTER_KERNEL_BUILDER(Name("TapehookScaleByFixed").Device(DEVICE_CPU),
                        ScaleBy16Op<true>);

#define REGISTER_CPU(T)                                                      \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("TapehookPackInput").Device(DEVICE_CPU).TypeConstraint<T>("T"),   \
      PackInputOp<T>);                                                       \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("TapehookUnpackInput").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
      UnpackInputOp<T>);

REGISTER_CPU(Eigen::half);
REGISTER_CPU(Eigen::bfloat16);
REGISTER_CPU(float);
REGISTER_CPU(double);

}  // namespace
}  // namespace tapehook
