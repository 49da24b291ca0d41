// Thin TensorFlow wrappers around cc_kernels/core/max_pool.h: max pools
// that keep their argmax as taps for the gradient.
#include <string>
#include <vector>

#include "core/max_pool.h"
#include "tf/op_common.h"
#include "tf/thread_pool.h"

namespace tapehook {
namespace {

REGISTER_OP("TapehookMaxPoolArgmax")
    .Input("input: float")
    .Output("output: float")
    .Output("argmax: int32")
    .Attr("ksize: list(int) >= 4")
    .Attr("strides: list(int) >= 4")
    .Attr("padding: {'SAME', 'VALID'}")
    .SetShapeFn(shape_inference::MaxPoolShape)
    .Doc(
        "NHWC max pool and each window's argmax within its image, as "
        "MaxPoolWithArgmax(include_batch_in_index=False) gives it "
        "(core/max_pool.h).");

REGISTER_OP("TapehookMaxPoolTaps")
    .Input("input: float")
    .Output("output: float")
    .Output("taps: int8")
    .Attr("ksize: list(int) >= 4")
    .Attr("strides: list(int) >= 4")
    .Attr("padding: {'SAME', 'VALID'}")
    .Attr("relu: bool = false")
    .SetShapeFn(shape_inference::MaxPoolShape)
    .Doc(
        "NHWC max pool and each window's maximum as its tap within the "
        "window, one byte; with relu (input a ReLU's output), dead taps where "
        "the maximum is not > 0 (core/max_pool.h MaxPoolTaps).");

REGISTER_OP("TapehookMaxPoolTapsGrad")
    .Input("grad: float")
    .Input("taps: int8")
    .Input("input_shape: int32")
    .Output("backprop: float")
    .Attr("ksize: list(int) >= 4")
    .Attr("strides: list(int) >= 4")
    .Attr("padding: {'SAME', 'VALID'}")
    .Attr("relu: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(2, &shape));
      TF_RETURN_IF_ERROR(c->WithRank(shape, 4, &shape));
      c->set_output(0, shape);
      return absl::OkStatus();
    })
    .Doc(
        "The input gradient of TapehookMaxPoolTaps from its taps; with relu, "
        "that of the ReLU's input (core/max_pool.h MaxPoolTapsBackprop).");

REGISTER_OP("TapehookMaxPoolTapsGather")
    .Input("values: float")
    .Input("taps: int8")
    .Output("output: float")
    .Attr("ksize: list(int) >= 4")
    .Attr("strides: list(int) >= 4")
    .Attr("padding: {'SAME', 'VALID'}")
    .Attr("relu: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->input(1));
      return absl::OkStatus();
    })
    .Doc(
        "values (the pool's input's shape) read at each tap: the derivative "
        "of TapehookMaxPoolTapsGrad in its grad (core/max_pool.h "
        "MaxPoolTapsGather).");

// The window and strides of the pool ops, and their geometry on an input.
class PoolOpBase : public OpKernel {
 public:
  explicit PoolOpBase(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::vector<int32_t> ksize, strides;
    std::string padding;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ksize", &ksize));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("strides", &strides));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("padding", &padding));
    OP_REQUIRES(ctx,
                ksize.size() == 4 && strides.size() == 4 && ksize[0] == 1 &&
                    ksize[3] == 1 && strides[0] == 1 && strides[3] == 1,
                errors::InvalidArgument(
                    "ksize and strides are [1, h, w, 1] (NHWC, spatial only)"));
    shape_.k_h = ksize[1];
    shape_.k_w = ksize[2];
    shape_.stride_h = strides[1];
    shape_.stride_w = strides[2];
    same_ = padding == "SAME";
  }

 protected:
  // The pool's geometry on an NHWC input of `dims`, or false (the error set
  // on ctx).
  bool Geometry(OpKernelContext* ctx, const TensorShape& dims, ConvShape* s) {
    if (dims.dims() != 4) {
      ctx->CtxFailure(errors::InvalidArgument("input must be NHWC, got shape ",
                                              dims.DebugString()));
      return false;
    }
    *s = shape_;
    s->batch = dims.dim_size(0);
    s->in_h = dims.dim_size(1);
    s->in_w = dims.dim_size(2);
    // The conv geometry with the window as filter (channels play no part:
    // 1 passes its filter check also for an input without channels).
    s->in_c = s->out_c = 1;
    const std::string problem = ComputeConvGeometry(
        same_ ? Padding::kSame : Padding::kValid, 0, 0, 0, 0, s);
    if (!problem.empty()) {
      ctx->CtxFailure(errors::InvalidArgument(problem));
      return false;
    }
    s->in_c = s->out_c = dims.dim_size(3);
    return true;
  }

  // The pool's output and what it keeps (output shape on s); false where
  // an error is set or the output is empty.
  static bool AllocatePooled(OpKernelContext* ctx, const ConvShape& s,
                             Tensor** y, Tensor** kept) {
    const TensorShape out_shape({s.batch, s.out_h, s.out_w, s.in_c});
    for (int index = 0; index < 2; ++index) {
      const auto status =
          ctx->allocate_output(index, out_shape, index == 0 ? y : kept);
      if (!status.ok()) {
        ctx->CtxFailure(status);
        return false;
      }
    }
    return (*y)->NumElements() > 0;
  }

  // Whether t has the pool's output shape on s (else the error set).
  bool IsOutputShaped(OpKernelContext* ctx, const ConvShape& s, const Tensor& t,
                      const char* what) {
    const TensorShape want({s.batch, s.out_h, s.out_w, s.in_c});
    if (t.shape() == want) return true;
    ctx->CtxFailure(
        errors::InvalidArgument(what, " has shape ", t.shape().DebugString(),
                                "; the pool's output is ", want.DebugString()));
    return false;
  }

  ConvShape shape_;  // the window and strides
  bool same_ = false;
};

// The ops of one-byte taps (core/max_pool.h MaxPoolTaps): their relu attr.
class TapsOpBase : public PoolOpBase {
 public:
  explicit TapsOpBase(OpKernelConstruction* ctx) : PoolOpBase(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("relu", &relu_));
  }

 protected:
  // The error of taps that MaxPoolTaps did not make for this geometry.
  static void BadTaps(OpKernelContext* ctx) {
    ctx->CtxFailure(errors::InvalidArgument(
        "taps name a position outside their window or the image: pass the "
        "taps TapehookMaxPoolTaps gave for this input shape, ksize, strides "
        "and padding"));
  }

  bool TapsFit(OpKernelContext* ctx) {
    if (shape_.k_h * shape_.k_w <= kMaxPoolTaps) return true;
    ctx->CtxFailure(
        errors::InvalidArgument("a ", shape_.k_h, "x", shape_.k_w,
                                " window has more than ", kMaxPoolTaps,
                                " taps: one byte cannot name them (use "
                                "TapehookMaxPoolArgmax)"));
    return false;
  }

  bool relu_ = false;
};

class MaxPoolArgmaxOp : public PoolOpBase {
 public:
  using PoolOpBase::PoolOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    ConvShape s;
    if (!Geometry(ctx, x.shape(), &s)) return;
    OP_REQUIRES(ctx, s.in_h * s.in_w * s.in_c < (int64_t{1} << 31),
                errors::InvalidArgument("an image of ", x.shape().DebugString(),
                                        " has 2**31 elements or more: int32 "
                                        "indices cannot address it"));
    Tensor *y = nullptr, *argmax = nullptr;
    if (!AllocatePooled(ctx, s, &y, &argmax)) return;
    MaxPoolArgmax(s, x.flat<float>().data(), y->flat<float>().data(),
                  argmax->flat<int32_t>().data(), ThreadPoolOf(ctx));
  }
};

class MaxPoolTapsOp : public TapsOpBase {
 public:
  using TapsOpBase::TapsOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    ConvShape s;
    if (!TapsFit(ctx) || !Geometry(ctx, x.shape(), &s)) return;
    Tensor *y = nullptr, *taps = nullptr;
    if (!AllocatePooled(ctx, s, &y, &taps)) return;
    MaxPoolTaps(s, x.flat<float>().data(), relu_, y->flat<float>().data(),
                taps->flat<int8_t>().data(), ThreadPoolOf(ctx));
  }
};

class MaxPoolTapsGradOp : public TapsOpBase {
 public:
  using TapsOpBase::TapsOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor &dy = ctx->input(0), &taps = ctx->input(1);
    const Tensor& dims = ctx->input(2);
    OP_REQUIRES(ctx, dims.dims() == 1 && dims.NumElements() == 4,
                errors::InvalidArgument("input_shape is the pool's NHWC input "
                                        "shape, 4 values; got ",
                                        dims.shape().DebugString()));
    TensorShape in_shape;
    OP_REQUIRES_OK(ctx,
                   TensorShapeUtils::MakeShape(dims.vec<int32_t>(), &in_shape));
    ConvShape s;
    if (!TapsFit(ctx) || !Geometry(ctx, in_shape, &s) ||
        !IsOutputShaped(ctx, s, dy, "grad") ||
        !IsOutputShaped(ctx, s, taps, "taps"))
      return;
    Tensor* dx = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, in_shape, &dx));
    if (dx->NumElements() == 0) return;
    if (!MaxPoolTapsBackprop(s, dy.flat<float>().data(),
                             taps.flat<int8_t>().data(), relu_,
                             dx->flat<float>().data(), ThreadPoolOf(ctx))) {
      BadTaps(ctx);
    }
  }
};

class MaxPoolTapsGatherOp : public TapsOpBase {
 public:
  using TapsOpBase::TapsOpBase;
  void Compute(OpKernelContext* ctx) override {
    const Tensor &v = ctx->input(0), &taps = ctx->input(1);
    ConvShape s;
    if (!TapsFit(ctx) || !Geometry(ctx, v.shape(), &s) ||
        !IsOutputShaped(ctx, s, taps, "taps"))
      return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, taps.shape(), &out));
    if (out->NumElements() == 0) return;
    if (!MaxPoolTapsGather(s, v.flat<float>().data(),
                           taps.flat<int8_t>().data(), relu_,
                           out->flat<float>().data(), ThreadPoolOf(ctx))) {
      BadTaps(ctx);
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TapehookMaxPoolArgmax").Device(DEVICE_CPU),
                        MaxPoolArgmaxOp);
REGISTER_KERNEL_BUILDER(Name("TapehookMaxPoolTaps").Device(DEVICE_CPU),
                        MaxPoolTapsOp);
REGISTER_KERNEL_BUILDER(Name("TapehookMaxPoolTapsGrad")
                            .Device(DEVICE_CPU)
                            .HostMemory("input_shape"),
                        MaxPoolTapsGradOp);
REGISTER_KERNEL_BUILDER(Name("TapehookMaxPoolTapsGather").Device(DEVICE_CPU),
                        MaxPoolTapsGatherOp);

}  // namespace
}  // namespace tapehook
