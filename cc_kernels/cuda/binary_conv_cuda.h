// Framework-free CUDA binary Conv2D (NHWC input, HWIO filter): the same math
// as the CPU core (core/binary_conv.h), on raw device pointers and a stream.
//
// Every call enqueues its kernels on `stream` and returns nullptr, or a static
// error message (unsupported size, launch failure). `workspace` is device
// memory of at least the matching *WorkspaceBytes(); nothing else is
// allocated. half is accumulated in float, as the CPU wrapper does.
//
// Plain C++: includes no CUDA header, so a host compiler can include it.
#ifndef TAPEHOOK_CUDA_BINARY_CONV_CUDA_H_
#define TAPEHOOK_CUDA_BINARY_CONV_CUDA_H_

#include <cstddef>

#include "core/binary_conv.h"

// The CUDA runtime's cudaStream_t is `CUstream_st*`.
struct CUstream_st;

namespace tapehook {
namespace cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1 };

size_t ForwardWorkspaceBytes(const ConvShape& s, bool binary_input);
size_t BackpropInputWorkspaceBytes(const ConvShape& s);
size_t BackpropFilterWorkspaceBytes(const ConvShape& s);

// y[batch, out_h, out_w, out_c] = conv2d(x_hat, W_hat). With binary_input
// the product is xor + popcount over bitpacked signs.
const char* BinaryConv2DForward(DType dtype, const ConvShape& s, const void* x,
                                const void* w, bool binary_input, Scale scale,
                                void* y, void* workspace, CUstream_st* stream);

// dx[batch, in_h, in_w, in_c]; x is read only when act_est != kNone.
const char* BinaryConv2DBackpropInput(DType dtype, const ConvShape& s,
                                      const void* x, const void* w,
                                      const void* dy, Estimator act_est,
                                      float clip, Scale scale, void* dx,
                                      void* workspace, CUstream_st* stream);

// dw[k_h, k_w, in_c, out_c]; act_est == kNone means the input is float.
const char* BinaryConv2DBackpropFilter(DType dtype, const ConvShape& s,
                                       const void* x, const void* w,
                                       const void* dy, Estimator act_est,
                                       Estimator w_est, float clip, Scale scale,
                                       void* dw, void* workspace,
                                       CUstream_st* stream);

// On GPUs of compute capability 8.0 and newer the calls above run
// tensor-core GEMMs (tc_conv.cu): bf16, and int8 for the fully binary
// forward; elsewhere the CUDA-core kernels. All compute the same math (the
// bf16 GEMMs' float operands split in two planes: within 2^-17 relative per
// product; the int8 one exact). For tests and benchmarks, process-wide:
// level 0 the CUDA-core kernels everywhere, 1 bf16 tensor cores only,
// 2 (the default) bf16 and int8.
void SetTensorCoreKernels(int level);

}  // namespace cuda
}  // namespace tapehook

#endif  // TAPEHOOK_CUDA_BINARY_CONV_CUDA_H_
