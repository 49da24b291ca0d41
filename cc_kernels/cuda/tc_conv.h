// Tensor-core (sm_80+) implicit GEMMs of the CUDA binary Conv2D
// (tc_conv.cu). binary_conv.cu computes alpha, dispatches here when
// TensorCoresUsable() and reduces BackpropFilter's partial sums; the math is
// the same as its CUDA-core kernels (tc_tiles.h says how operands are
// staged). Every function enqueues on `stream` and returns nullptr or a
// static error message.
#ifndef TAPEHOOK_CUDA_TC_CONV_H_
#define TAPEHOOK_CUDA_TC_CONV_H_

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/conv_tiles.h"

namespace tapehook {
namespace cuda {

// True where the current device has bf16 tensor cores (compute capability
// 8.0 or newer), SetTensorCoreKernels has not switched them off, and g's
// staged operands fit 32-bit offsets.
bool TensorCoresUsable(const Geom& g);

// Workspace the staged operands take (BackpropFilter's partials not
// included: the caller places them).
size_t TcForwardBytes(const Geom& g, bool binary_input);
size_t TcBackpropInputBytes(const Geom& g);
size_t TcBackpropFilterBytes(const Geom& g);
// Pixel splits of BackpropFilter's reduction (partials [splits, filter_k,
// out_c]).
int TcFilterSplits(const Geom& g);

template <typename T>
const char* TcForward(const Geom& g, const T* x, const T* w, bool binary_input,
                      const float* alpha, T* y, void* workspace,
                      cudaStream_t stream);

template <typename T>
const char* TcBackpropInput(const Geom& g, const T* x, const T* w, const T* dy,
                            const float* alpha, Estimator act_est, float clip,
                            T* dx, void* workspace, cudaStream_t stream);

// partial[z, filter_k, out_c] = split z's sum over pixels of im2col * dy.
template <typename T>
const char* TcBackpropFilterPartials(const Geom& g, const T* x, const T* dy,
                                     bool binary_input, float* partial,
                                     void* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace tapehook

#endif  // TAPEHOOK_CUDA_TC_CONV_H_
