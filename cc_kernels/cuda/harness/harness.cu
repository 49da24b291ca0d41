// extern "C" shim of the framework-free GPU harness (bench/cuda_harness.py,
// loaded with ctypes): the CUDA kernels, the CPU core as their reference,
// and plain CUDA memory for callers without PyTorch. No TensorFlow.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "core/binary_conv.h"
#include "cuda/binary_conv_cuda.h"

namespace {

using namespace tapehook;

// The CPU reference on all cores: contiguous shards, one thread each.
void ThreadsFor(int64_t total, int64_t,
                const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t threads = std::min<int64_t>(
      total, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t b = total * t / threads, e = total * (t + 1) / threads;
    pool.emplace_back([&fn, b, e] { fn(b, e); });
  }
  for (auto& th : pool) th.join();
}

const char* Status(cudaError_t err) {
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

cuda::DType DTypeOf(int dtype) { return static_cast<cuda::DType>(dtype); }
CUstream_st* StreamOf(void* stream) {
  return static_cast<CUstream_st*>(stream);
}

}  // namespace

extern "C" {

// Fills out_h, out_w, pad_top, pad_left; padding 0 SAME, 1 VALID, 2 EXPLICIT.
const char* th_geometry(int padding, int64_t pad_t, int64_t pad_b,
                        int64_t pad_l, int64_t pad_r, ConvShape* s) {
  static thread_local std::string err;
  err = ComputeConvGeometry(static_cast<Padding>(padding), pad_t, pad_b, pad_l,
                            pad_r, s);
  return err.empty() ? nullptr : err.c_str();
}

// Kernel family, cuda::SetTensorCoreKernels' level: 2 (the default) bf16
// and int8 tensor cores where the GPU has them, 1 bf16 only, 0 CUDA cores.
void th_set_tensor_cores(int level) { cuda::SetTensorCoreKernels(level); }

// op: 0 forward, 1 backprop input, 2 backprop filter.
size_t th_workspace_bytes(int op, const ConvShape* s, int binary) {
  switch (op) {
    case 0:
      return cuda::ForwardWorkspaceBytes(*s, binary != 0);
    case 1:
      return cuda::BackpropInputWorkspaceBytes(*s);
    default:
      return cuda::BackpropFilterWorkspaceBytes(*s);
  }
}

const char* th_cuda_forward(int dtype, const ConvShape* s, const void* x,
                            const void* w, int binary, int scale, void* y,
                            void* workspace, void* stream) {
  return cuda::BinaryConv2DForward(DTypeOf(dtype), *s, x, w, binary != 0,
                                   static_cast<Scale>(scale), y, workspace,
                                   StreamOf(stream));
}

const char* th_cuda_backprop_input(int dtype, const ConvShape* s, const void* x,
                                   const void* w, const void* dy, int act_est,
                                   float clip, int scale, void* dx,
                                   void* workspace, void* stream) {
  return cuda::BinaryConv2DBackpropInput(
      DTypeOf(dtype), *s, x, w, dy, static_cast<Estimator>(act_est), clip,
      static_cast<Scale>(scale), dx, workspace, StreamOf(stream));
}

const char* th_cuda_backprop_filter(int dtype, const ConvShape* s,
                                    const void* x, const void* w,
                                    const void* dy, int act_est, int w_est,
                                    float clip, int scale, void* dw,
                                    void* workspace, void* stream) {
  return cuda::BinaryConv2DBackpropFilter(
      DTypeOf(dtype), *s, x, w, dy, static_cast<Estimator>(act_est),
      static_cast<Estimator>(w_est), clip, static_cast<Scale>(scale), dw,
      workspace, StreamOf(stream));
}

void th_cpu_forward(const ConvShape* s, const float* x, const float* w,
                    int binary, int scale, float* y) {
  BinaryConv2DForward<float>(*s, x, w, binary != 0, static_cast<Scale>(scale),
                             y, ThreadsFor);
}

void th_cpu_backprop_input(const ConvShape* s, const float* x, const float* w,
                           const float* dy, int act_est, float clip, int scale,
                           float* dx) {
  BinaryConv2DBackpropInput<float>(*s, x, w, dy,
                                   static_cast<Estimator>(act_est), clip,
                                   static_cast<Scale>(scale), dx, ThreadsFor);
}

void th_cpu_backprop_filter(const ConvShape* s, const float* x, const float* w,
                            const float* dy, int act_est, int w_est, float clip,
                            int scale, float* dw) {
  BinaryConv2DBackpropFilter<float>(*s, x, w, dy,
                                    static_cast<Estimator>(act_est),
                                    static_cast<Estimator>(w_est), clip,
                                    static_cast<Scale>(scale), dw, ThreadsFor);
}

const char* th_malloc(size_t bytes, void** ptr) {
  return Status(cudaMalloc(ptr, std::max<size_t>(bytes, 1)));
}
const char* th_free(void* ptr) { return Status(cudaFree(ptr)); }
const char* th_to_device(void* dst, const void* src, size_t bytes) {
  return Status(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
const char* th_to_host(void* dst, const void* src, size_t bytes) {
  return Status(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
// Waits for all work and reports any asynchronous kernel error.
const char* th_synchronize() { return Status(cudaDeviceSynchronize()); }
const char* th_device_name() {
  static thread_local std::string name;
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "unknown";
  name = prop.name;
  return name.c_str();
}

}  // extern "C"
