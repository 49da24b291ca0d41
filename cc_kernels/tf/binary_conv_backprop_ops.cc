// Thin TensorFlow wrappers around the binary conv backprops
// (cc_kernels/core/binary_conv.h, and packed_backprop.h for an input kept
// as packed bits): op registration, attr parsing, shape checks, dtype
// adaptation and threads.
#include <string>
#include <type_traits>
#include <vector>

#include "core/binary_conv.h"
#include "core/pack_input.h"
#include "core/packed_backprop.h"
#include "core/plan.h"
#include "tf/conv_attrs.h"
#include "tf/op_common.h"
#include "tf/thread_pool.h"

namespace tapehook {
namespace {

REGISTER_OP("TapehookBinaryConv2DBackpropInput")
    .Input("input: T")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("input_backprop: T")
    .TAPEHOOK_BACKPROP_ATTRS.SetShapeFn(
        [](shape_inference::InferenceContext* c) {
          c->set_output(0, c->input(0));
          return absl::OkStatus();
        });

REGISTER_OP("TapehookBinaryConv2DBackpropFilter")
    .Input("input: T")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("filter_backprop: T")
    .TAPEHOOK_BACKPROP_ATTRS.SetShapeFn(
        [](shape_inference::InferenceContext* c) {
          c->set_output(0, c->input(1));
          return absl::OkStatus();
        });

REGISTER_OP("TapehookBinaryConv2DBackpropInputPacked")
    .Input("packed: uint8")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("input_backprop: T")
    .TAPEHOOK_BACKPROP_ATTRS.Attr("channels: int")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(UnpackedShape(c, /*rank=*/4, &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(
        "TapehookBinaryConv2DBackpropInput of a ste_sign binary-activation "
        "conv whose input is given as TapehookPackInput bits.");

REGISTER_OP("TapehookBinaryConv2DBackpropFilterPacked")
    .Input("packed: uint8")
    .Input("filter: T")
    .Input("out_backprop: T")
    .Output("filter_backprop: T")
    .TAPEHOOK_BACKPROP_ATTRS.Attr("channels: int")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    })
    .Doc(
        "TapehookBinaryConv2DBackpropFilter of a ste_sign binary-activation "
        "conv whose input is given as TapehookPackInput bits.");

// Both backprops take (input, filter, out_backprop); kFilter selects the core
// call.
template <typename T, bool kFilter>
class BinaryConv2DBackpropOp : public OpKernel {
  static constexpr ConvOp kOp =
      kFilter ? ConvOp::kBackpropFilter : ConvOp::kBackpropInput;

 public:
  explicit BinaryConv2DBackpropOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ParseDySplit(ctx, &dy_split_));
  }
  void Compute(OpKernelContext* ctx) override {
    ConvShape s;
    Tensor* grad = nullptr;
    OP_REQUIRES_OK(ctx, PrepareBackprop(ctx, attrs_, kFilter, &s, &grad));
    if (grad->NumElements() == 0) return;
    using C = typename Compute<T>::type;
    Impl impl;
    OP_REQUIRES_OK(
        ctx, PlanFor(attrs_, kOp, s, false, std::is_same_v<C, double>, &impl));
    Widened<T> xw(ctx->input(0)), ww(ctx->input(1)), dyw(ctx->input(2));
    WidenedOut<T> out(grad);
    const double clip = attrs_.ClipFor<C>();
    if (kFilter) {
      BinaryConv2DBackpropFilter(s, xw.data(), ww.data(), dyw.data(),
                                 attrs_.act_est, attrs_.weight_est, clip,
                                 attrs_.scale, out.data(), ThreadPoolOf(ctx),
                                 impl, dy_split_);
    } else {
      BinaryConv2DBackpropInput(s, xw.data(), ww.data(), dyw.data(),
                                attrs_.act_est, clip, attrs_.scale, out.data(),
                                ThreadPoolOf(ctx), impl, dy_split_);
    }
    out.Store();
    CountDispatch(kFilter ? kBackpropFilter : kBackpropInput);
  }

 private:
  ConvAttrs attrs_;
  DySplit dy_split_ = DySplit::kExact;
};

// The backprops reading the input as packed bits (core/pack_input.h).
template <typename T, bool kFilter>
class PackedBackpropOp : public OpKernel {
 public:
  explicit PackedBackpropOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseAttrs(ctx, &attrs_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channels", &channels_));
    OP_REQUIRES_OK(ctx, ParseDySplit(ctx, &dy_split_));
    OP_REQUIRES(ctx, attrs_.act_est == Estimator::kSteSign,
                errors::InvalidArgument(
                    "packed input bits hold the ste_sign mask only; use "
                    "activation_estimator='ste_sign'"));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    OP_REQUIRES(
        ctx, packed.dims() == 4 && packed.dim_size(3) == PackedBytes(channels_),
        errors::InvalidArgument("packed input ", packed.shape().DebugString(),
                                " does not hold ", channels_, " channels"));
    TensorShape x_shape = packed.shape();
    x_shape.set_dim(3, channels_);
    const Tensor& w = ctx->input(1);
    ConvShape s;
    OP_REQUIRES_OK(ctx, MakeShape(attrs_, x_shape, w.shape(), &s));
    OP_REQUIRES_OK(ctx, CheckOutBackprop(s, ctx->input(2)));
    Tensor* grad = nullptr;
    OP_REQUIRES_OK(
        ctx, ctx->allocate_output(0, kFilter ? w.shape() : x_shape, &grad));
    if (grad->NumElements() == 0) return;
    using C = typename Compute<T>::type;
    Impl impl;
    OP_REQUIRES_OK(
        ctx, PlanFor(attrs_,
                     kFilter ? ConvOp::kBackpropFilter : ConvOp::kBackpropInput,
                     s, true, std::is_same_v<C, double>, &impl));
    Widened<T> ww(w), dyw(ctx->input(2));
    WidenedOut<T> out(grad);
    const uint8_t* bits = packed.flat<uint8_t>().data();
    const double clip = attrs_.ClipFor<C>();
    if (kFilter) {
      BinaryConv2DBackpropFilterPacked(
          s, bits, ww.data(), dyw.data(), attrs_.weight_est, clip, attrs_.scale,
          out.data(), ThreadPoolOf(ctx), impl, dy_split_);
    } else {
      BinaryConv2DBackpropInputPacked(s, bits, ww.data(), dyw.data(), clip,
                                      attrs_.scale, out.data(),
                                      ThreadPoolOf(ctx), impl, dy_split_);
    }
    out.Store();
    CountDispatch(kFilter ? kBackpropFilter : kBackpropInput);
  }

 private:
  ConvAttrs attrs_;
  DySplit dy_split_ = DySplit::kExact;
  int64_t channels_;
};

template <typename T>
using PackedBackpropInputOp = PackedBackpropOp<T, false>;
template <typename T>
using PackedBackpropFilterOp = PackedBackpropOp<T, true>;
template <typename T>
using BackpropInputOp = BinaryConv2DBackpropOp<T, false>;
template <typename T>
using BackpropFilterOp = BinaryConv2DBackpropOp<T, true>;

#define REGISTER_CPU(T)                                                    \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropInput")        \
                              .Device(DEVICE_CPU)                          \
                              .TypeConstraint<T>("T"),                     \
                          BackpropInputOp<T>);                             \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropFilter")       \
                              .Device(DEVICE_CPU)                          \
                              .TypeConstraint<T>("T"),                     \
                          BackpropFilterOp<T>);                            \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropInputPacked")  \
                              .Device(DEVICE_CPU)                          \
                              .TypeConstraint<T>("T"),                     \
                          PackedBackpropInputOp<T>);                       \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropFilterPacked") \
                              .Device(DEVICE_CPU)                          \
                              .TypeConstraint<T>("T"),                     \
                          PackedBackpropFilterOp<T>);

REGISTER_CPU(Eigen::half);
REGISTER_CPU(Eigen::bfloat16);
REGISTER_CPU(float);
REGISTER_CPU(double);

}  // namespace
}  // namespace tapehook
