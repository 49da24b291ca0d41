// DEVICE_GPU kernels of the three tapehook ops (registered in
// binary_conv_ops.cc): attrs and shapes as on the CPU (tf/conv_attrs.h), the
// math in cuda/binary_conv_cuda.h, enqueued on the op's TF stream. TF's GPU
// allocator provides the outputs and the kernels' workspace.
//
// Built only with -DGOOGLE_CUDA=1 (tapehook/cuda_build.py); in the CPU
// library this file is empty.
#if GOOGLE_CUDA

#include <algorithm>
#include <string>

#include "cuda/binary_conv_cuda.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tf/conv_attrs.h"
#include "xla/stream_executor/stream.h"

namespace tapehook {
namespace {

using ::tensorflow::DEVICE_GPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

template <typename T>
constexpr cuda::DType kDType = cuda::DType::kFloat32;
template <>
constexpr cuda::DType kDType<Eigen::half> = cuda::DType::kFloat16;

CUstream_st* StreamOf(OpKernelContext* ctx) {
  return static_cast<CUstream_st*>(
      ctx->op_device_context()->stream()->platform_specific_handle().stream);
}

// Device scratch of `bytes` (at least 1, so the pointer is never null).
absl::Status AllocateWorkspace(OpKernelContext* ctx, size_t bytes,
                               Tensor* scratch) {
  return ctx->allocate_temp(
      ::tensorflow::DT_UINT8,
      TensorShape({std::max<int64_t>(1, static_cast<int64_t>(bytes))}),
      scratch);
}

absl::Status CudaStatus(const char* err) {
  if (err == nullptr) return absl::OkStatus();
  return ::tensorflow::errors::Internal("tapehook CUDA binary conv: ", err);
}

template <typename T>
class BinaryConv2DGpuOp : public OpKernel {
 public:
  explicit BinaryConv2DGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseAttrs(ctx, &attrs_));
    int num_threshold = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_threshold", &num_threshold));
    std::string balance;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("balance", &balance));
    OP_REQUIRES(ctx, balance == "none",
                absl::InvalidArgumentError(
                    "TapehookBinaryConv2D: balance runs on the CPU kernels "
                    "only; binarize a balanced kernel on a GPU"));
    OP_REQUIRES(ctx, num_threshold == 0,
                absl::InvalidArgumentError(
                    "TapehookBinaryConv2D: the threshold input runs on the "
                    "CPU kernels only; binarize x - threshold first on a GPU"));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& w = ctx->input(1);
    ConvShape s;
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, PrepareForward(ctx, attrs_, &s, &y));
    if (y->NumElements() == 0) return;
    const bool binary = attrs_.act_est != Estimator::kNone;
    Tensor scratch;
    OP_REQUIRES_OK(
        ctx, AllocateWorkspace(ctx, cuda::ForwardWorkspaceBytes(s, binary),
                               &scratch));
    OP_REQUIRES_OK(ctx,
                   CudaStatus(cuda::BinaryConv2DForward(
                       kDType<T>, s, x.data(), w.data(), binary, attrs_.scale,
                       y->data(), scratch.data(), StreamOf(ctx))));
    CountDispatch(kForward);
  }

 private:
  ConvAttrs attrs_;
};

template <typename T, bool kFilter>
class BinaryConv2DBackpropGpuOp : public OpKernel {
 public:
  explicit BinaryConv2DBackpropGpuOp(OpKernelConstruction* ctx)
      : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ParseAttrs(ctx, &attrs_));
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& w = ctx->input(1);
    const Tensor& dy = ctx->input(2);
    ConvShape s;
    Tensor* grad = nullptr;
    OP_REQUIRES_OK(ctx, PrepareBackprop(ctx, attrs_, kFilter, &s, &grad));
    if (grad->NumElements() == 0) return;
    Tensor scratch;
    OP_REQUIRES_OK(
        ctx, AllocateWorkspace(ctx,
                               kFilter ? cuda::BackpropFilterWorkspaceBytes(s)
                                       : cuda::BackpropInputWorkspaceBytes(s),
                               &scratch));
    const char* err =
        kFilter ? cuda::BinaryConv2DBackpropFilter(
                      kDType<T>, s, x.data(), w.data(), dy.data(),
                      attrs_.act_est, attrs_.weight_est, attrs_.clip,
                      attrs_.scale, grad->data(), scratch.data(), StreamOf(ctx))
                : cuda::BinaryConv2DBackpropInput(
                      kDType<T>, s, x.data(), w.data(), dy.data(),
                      attrs_.act_est, attrs_.clip, attrs_.scale, grad->data(),
                      scratch.data(), StreamOf(ctx));
    OP_REQUIRES_OK(ctx, CudaStatus(err));
    CountDispatch(kFilter ? kBackpropFilter : kBackpropInput);
  }

 private:
  ConvAttrs attrs_;
};

#define REGISTER_GPU(T)                                                       \
  REGISTER_KERNEL_BUILDER(                                                    \
      Name("TapehookBinaryConv2D").Device(DEVICE_GPU).TypeConstraint<T>("T"), \
      BinaryConv2DGpuOp<T>);                                                  \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropInput")           \
                              .Device(DEVICE_GPU)                             \
                              .TypeConstraint<T>("T"),                        \
                          (BinaryConv2DBackpropGpuOp<T, false>));             \
  REGISTER_KERNEL_BUILDER(Name("TapehookBinaryConv2DBackpropFilter")          \
                              .Device(DEVICE_GPU)                             \
                              .TypeConstraint<T>("T"),                        \
                          (BinaryConv2DBackpropGpuOp<T, true>));

REGISTER_GPU(Eigen::half);
REGISTER_GPU(float);
#undef REGISTER_GPU

}  // namespace
}  // namespace tapehook

#endif  // GOOGLE_CUDA
