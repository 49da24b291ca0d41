// Thin TensorFlow wrapper around cc_kernels/core/batch_norm.h: the fused
// batch-norm gradient op.
#include "core/batch_norm.h"
#include "tf/op_common.h"
#include "tf/thread_pool.h"

namespace tapehook {
namespace {

REGISTER_OP("TapehookBatchNormGrad")
    .Input("grad: float")
    .Input("x: float")
    .Input("scale: float")
    .Input("mean: float")
    .Input("inv_std: float")
    .Output("x_backprop: float")
    .Output("scale_backprop: float")
    .Output("offset_backprop: float")
    .Attr("relu: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      // x_backprop as grad; the two per-channel sums as scale.
      for (int i = 0; i < 3; ++i) c->set_output(i, c->input(i == 0 ? 0 : 2));
      return absl::OkStatus();
    })
    .Doc(
        "Gradient of a training-mode batch norm over the last axis (batch "
        "statistics mean and inv_std; with relu, of the batch norm of "
        "relu(x) followed by the ReLU's backward), written over grad where "
        "TF lets it (core/batch_norm.h).");

class BatchNormGradOp : public OpKernel {
 public:
  explicit BatchNormGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("relu", &relu_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor &grad = ctx->input(0), &x = ctx->input(1);
    OP_REQUIRES(ctx, grad.shape() == x.shape() && x.dims() >= 1,
                errors::InvalidArgument(
                    "grad ", grad.shape().DebugString(), " and x ",
                    x.shape().DebugString(),
                    " must have the same shape, of rank 1 or more"));
    const int64_t channels = x.dim_size(x.dims() - 1);
    for (int i = 2; i < 5; ++i) {
      OP_REQUIRES(
          ctx,
          ctx->input(i).dims() == 1 && ctx->input(i).dim_size(0) == channels,
          errors::InvalidArgument("scale, mean and inv_std must be [", channels,
                                  "] (x's channels), got ",
                                  ctx->input(i).shape().DebugString()));
    }
    Tensor *dx = nullptr, *dscale = nullptr, *doffset = nullptr;
    OP_REQUIRES_OK(
        ctx, ctx->forward_input_or_allocate_output({0}, 0, grad.shape(), &dx));
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(1, TensorShape({channels}), &dscale));
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(2, TensorShape({channels}), &doffset));
    const int64_t rows = channels == 0 ? 0 : x.NumElements() / channels;
    if (channels == 0) return;
    BatchNormGrad(grad.flat<float>().data(), x.flat<float>().data(), rows,
                  channels, ctx->input(2).flat<float>().data(),
                  ctx->input(3).flat<float>().data(),
                  ctx->input(4).flat<float>().data(), relu_,
                  dx->flat<float>().data(), dscale->flat<float>().data(),
                  doffset->flat<float>().data(), ThreadPoolOf(ctx));
  }

 private:
  bool relu_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TapehookBatchNormGrad").Device(DEVICE_CPU),
                        BatchNormGradOp);

}  // namespace
}  // namespace tapehook
