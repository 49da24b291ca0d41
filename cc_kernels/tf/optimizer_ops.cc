// Thin TensorFlow wrapper around cc_kernels/core/adam.h: the fused Adam
// update with a weight clip on resource variables, locked and copied as TF's
// own ResourceApplyAdam does (training_op_helpers.h, whose templates need
// Eigen's thread-pool device).
#define EIGEN_USE_THREADS

#include <cmath>

#include "core/adam.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tf/thread_pool.h"

namespace tapehook {
namespace {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShapeUtils;
namespace shape_inference = ::tensorflow::shape_inference;
namespace errors = ::tensorflow::errors;

REGISTER_OP("TapehookResourceApplyAdamClip")
    .Input("var: resource")
    .Input("m: resource")
    .Input("v: resource")
    .Input("beta1_power: float")
    .Input("beta2_power: float")
    .Input("lr: float")
    .Input("beta1: float")
    .Input("beta2: float")
    .Input("epsilon: float")
    .Input("grad: float")
    .Attr("clip: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      for (int i = 3; i < 9; ++i) {
        shape_inference::ShapeHandle unused;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
      }
      return absl::OkStatus();
    })
    .Doc(
        "ResourceApplyAdam's update of a float32 variable followed by a clip "
        "to [-clip, clip], in one pass over var, m, v and grad "
        "(core/adam.h): tapehook.optimizers.Adam for a variable whose "
        "constraint is a WeightClip.");

class ApplyAdamClipOp : public OpKernel {
 public:
  explicit ApplyAdamClipOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("clip", &clip_));
    OP_REQUIRES(ctx, clip_ > 0.0f && std::isfinite(clip_),
                errors::InvalidArgument("clip must be positive and finite, "
                                        "got ",
                                        clip_));
  }
  void Compute(OpKernelContext* ctx) override {
    using CPUDevice = Eigen::ThreadPoolDevice;
    // float32 variables only (the core's type): checked before the helpers
    // below read them as float.
    for (int i = 0; i < 3; ++i) {
      ::tensorflow::core::RefCountPtr<::tensorflow::Var> variable;
      OP_REQUIRES_OK(
          ctx, ::tensorflow::LookupResource(
                   ctx, ::tensorflow::HandleFromInput(ctx, i), &variable));
      OP_REQUIRES(
          ctx, variable->tensor()->dtype() == ::tensorflow::DT_FLOAT,
          errors::InvalidArgument(
              "TapehookResourceApplyAdamClip: var, m and v must be "
              "float32 variables; input ",
              i, " is ",
              ::tensorflow::DataTypeString(variable->tensor()->dtype())));
    }
    // As ResourceApplyAdam: the three variables locked in address order, and
    // each copied first where a pending read still holds its buffer.
    auto locks =
        ::tensorflow::MaybeLockVariableInputMutexesInOrder<CPUDevice, float>(
            ctx, /*do_lock=*/true, /*sparse=*/false, {0, 1, 2});
    Tensor var, m, v;
    OP_REQUIRES_OK(ctx,
                   ::tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                       ctx, 0, true, false, &var));
    OP_REQUIRES_OK(ctx,
                   ::tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                       ctx, 1, true, false, &m));
    OP_REQUIRES_OK(ctx,
                   ::tensorflow::GetInputTensorFromVariable<CPUDevice, float>(
                       ctx, 2, true, false, &v));
    OP_REQUIRES(ctx,
                var.IsInitialized() && m.IsInitialized() && v.IsInitialized(),
                errors::FailedPrecondition(
                    "TapehookResourceApplyAdamClip: var, m and v must be "
                    "initialized variables"));
    const Tensor& grad = ctx->input(9);
    OP_REQUIRES(
        ctx,
        var.shape() == m.shape() && var.shape() == v.shape() &&
            var.shape() == grad.shape(),
        errors::InvalidArgument(
            "TapehookResourceApplyAdamClip: var, m, v and grad must "
            "have one shape; got ",
            var.shape().DebugString(), ", ", m.shape().DebugString(), ", ",
            v.shape().DebugString(), " and ", grad.shape().DebugString()));
    float scalars[6];
    for (int i = 0; i < 6; ++i) {
      const Tensor& t = ctx->input(3 + i);
      OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(t.shape()),
                  errors::InvalidArgument(
                      "TapehookResourceApplyAdamClip: input ", 3 + i,
                      " must be a scalar, got ", t.shape().DebugString()));
      scalars[i] = t.scalar<float>()();
    }
    const AdamStep step =
        AdamScalars(/*lr=*/scalars[2], /*beta1_power=*/scalars[0],
                    /*beta2_power=*/scalars[1], /*beta1=*/scalars[3],
                    /*beta2=*/scalars[4], /*epsilon=*/scalars[5], clip_);
    AdamClipUpdate(var.flat<float>().data(), m.flat<float>().data(),
                   v.flat<float>().data(), grad.flat<float>().data(),
                   var.NumElements(), step, ThreadPoolOf(ctx));
  }

 private:
  float clip_ = 0.0f;
};

REGISTER_KERNEL_BUILDER(
    Name("TapehookResourceApplyAdamClip").Device(DEVICE_CPU), ApplyAdamClipOp);

}  // namespace
}  // namespace tapehook
