// CUDA binary Conv2D: implicit GEMMs whose tile loaders and epilogues are the
// __host__ __device__ functions of conv_tiles.h (the host tests run those
// same functions against the CPU core).
//
// Every GEMM uses a 64 x 64 output tile per 256-thread block, each thread
// owning a 4 x 4 register tile strided by 16 (so shared-memory reads are
// broadcasts or consecutive, and global stores coalesce along channels).
//   forward, binary input: [pixels, words] x [words, out_c], xor + popcount
//   forward, float input:  im2col(x) [pixels, K] x sign(W) [K, out_c]
//   backprop input:        gathered dy [in pixels, taps*out_c] x W_hat^T
//   backprop filter:       im2col^T [K, pixels] x dy [pixels, out_c], split
//                          over pixel ranges, reduced in a fixed order
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "cuda/binary_conv_cuda.h"
#include "cuda/conv_tiles.h"
#include "cuda/tc_conv.h"

namespace tapehook {
namespace cuda {
namespace {

constexpr int kTile = 64;      // output tile edge (rows and columns)
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
constexpr int kDepth = 16;     // float reduction step per shared tile
constexpr int kWordDepth = 8;  // packed-word reduction step (256 bits)
constexpr int kMicro = 4;
constexpr int kLanes = kTile / kMicro;  // 16
constexpr size_t kAlign = 256;

// Splits of BackpropFilter's pixel reduction: enough blocks to fill a large
// GPU, at least kMinSplitPixels pixels each. Depends on the shape only, so
// results do not depend on the device.
constexpr int kTargetBlocks = 512;
constexpr int kMaxSplits = 64;
constexpr int kMinSplitPixels = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
int CeilDiv(int a, int b) { return (a + b - 1) / b; }

int FilterSplits(const Geom& g) {
  const int tiles = CeilDiv(g.filter_k, kTile) * CeilDiv(g.out_c, kTile);
  int splits = CeilDiv(kTargetBlocks, tiles);
  splits = std::min(splits, std::max(1, CeilDiv(g.out_pix, kMinSplitPixels)));
  splits = std::min(splits, kMaxSplits);
  // Partial-sum offsets are 32-bit.
  const long long kn = (long long)g.filter_k * g.out_c;
  splits = (int)std::min<long long>(splits, INT_MAX / kn);
  return std::max(splits, 1);
}

// Null if every tensor and index the kernels touch fits 32-bit offsets.
const char* CheckSizes(const ConvShape& s) {
  const long long limit = INT_MAX;
  const long long x = s.batch * s.in_h * s.in_w * s.in_c;
  const long long y = s.batch * s.out_h * s.out_w * s.out_c;
  const long long w = s.k_h * s.k_w * s.in_c * s.out_c;
  if (x >= limit || y >= limit || w >= limit) {
    return "tapehook CUDA binary conv: input, output and filter must each "
           "have fewer than 2^31 elements";
  }
  return nullptr;
}

const char* LaunchStatus() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Workspace layout: alpha (out_c floats) first, then the op's own buffers.
struct PackedBuffers {
  float* alpha;
  uint32_t* xbits;
  uint32_t* wbits;
  int* wpop;
};

size_t AlphaBytes(const Geom& g) { return AlignUp(sizeof(float) * g.out_c); }
size_t XBitsBytes(const Geom& g) {
  return AlignUp(sizeof(uint32_t) * size_t(g.in_pix) * g.words);
}
size_t WBitsBytes(const Geom& g) {
  return AlignUp(sizeof(uint32_t) * size_t(g.taps) * g.words * g.out_c);
}
size_t WPopBytes(const Geom& g) {
  return AlignUp(sizeof(int) * size_t(g.taps) * g.out_c);
}

size_t PartialBytes(const Geom& g, int splits) {
  return AlignUp(sizeof(float) * size_t(splits) * g.filter_k * g.out_c);
}

PackedBuffers Carve(const Geom& g, void* workspace) {
  char* p = static_cast<char*>(workspace);
  PackedBuffers b;
  b.alpha = reinterpret_cast<float*>(p);
  p += AlphaBytes(g);
  b.xbits = reinterpret_cast<uint32_t*>(p);
  p += XBitsBytes(g);
  b.wbits = reinterpret_cast<uint32_t*>(p);
  p += WBitsBytes(g);
  b.wpop = reinterpret_cast<int*>(p);
  return b;
}

// ---------------------------------------------------------------------------
// Small elementwise kernels.

constexpr int kAlphaRows = 32;  // threads splitting the rows of one column

// alpha[o]: 32 columns per block, kAlphaRows partial sums each, added in a
// fixed order.
template <typename T>
__global__ void AlphaKernel(Geom g, const T* w, Scale scale, float* alpha) {
  __shared__ float part[kAlphaRows][32];
  const int o = blockIdx.x * 32 + threadIdx.x;
  const bool mean_abs = scale == Scale::kMeanAbs;
  part[threadIdx.y][threadIdx.x] =
      mean_abs && o < g.out_c ? AbsColumnSum(g, w, o, threadIdx.y, kAlphaRows)
                              : 0.0f;
  __syncthreads();
  if (threadIdx.y != 0 || o >= g.out_c) return;
  float sum = 0.0f;
  for (int r = 0; r < kAlphaRows; ++r) sum += part[r][threadIdx.x];
  alpha[o] = mean_abs ? sum / float(g.filter_k) : 1.0f;
}

template <typename T>
__global__ void PackInputKernel(Geom g, const T* x, uint32_t* xbits) {
  const int total = g.in_pix * g.words;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    const int pix = i / g.words;
    xbits[i] = PackSignWord(x + pix * g.in_c, 1, i % g.words, g.in_c);
  }
}

template <typename T>
__global__ void PackFilterKernel(Geom g, const T* w, uint32_t* wbits,
                                 int* wpop) {
  const int total = g.taps * g.out_c;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    wpop[i] = PackFilterTap(g, w, i / g.out_c, i % g.out_c, wbits);
  }
}

int GridFor(int total) {
  return std::max(1, std::min(CeilDiv(total, kThreads), 4096));
}

// ---------------------------------------------------------------------------
// GEMM kernels.

__device__ __forceinline__ void AccumulateTile(const float (&a)[kDepth][kTile],
                                               const float (&b)[kDepth][kTile],
                                               int tx, int ty,
                                               float (&acc)[kMicro][kMicro]) {
#pragma unroll
  for (int kk = 0; kk < kDepth; ++kk) {
    float av[kMicro], bv[kMicro];
#pragma unroll
    for (int i = 0; i < kMicro; ++i) av[i] = a[kk][ty + kLanes * i];
#pragma unroll
    for (int j = 0; j < kMicro; ++j) bv[j] = b[kk][tx + kLanes * j];
#pragma unroll
    for (int i = 0; i < kMicro; ++i) {
#pragma unroll
      for (int j = 0; j < kMicro; ++j)
        acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
  }
}

// Loads of a [kDepth, kTile] shared tile: 4 elements per thread, either the
// depth index fastest (for A: channels are contiguous in x and dy) or the
// tile column fastest (for B: out_c is contiguous in W and dy).
constexpr int kLoads = kDepth * kTile / kThreads;  // 4

template <typename T>
__global__ void __launch_bounds__(kThreads)
    BinaryInputForwardKernel(Geom g, const uint32_t* xbits,
                             const uint32_t* wbits, const int* wpop,
                             const float* alpha, T* y) {
  __shared__ uint32_t as[kWordDepth][kTile];
  __shared__ uint32_t bs[kWordDepth][kTile];
  const int tid = threadIdx.x, tx = tid % kLanes, ty = tid / kLanes;
  const int m0 = blockIdx.x * kTile, n0 = blockIdx.y * kTile;
  constexpr int kWordLoads = kWordDepth * kTile / kThreads;  // 2
  constexpr int kRowsPerPass = kThreads / kWordDepth;        // 32
  OutPixel rows[kWordLoads];
#pragma unroll
  for (int i = 0; i < kWordLoads; ++i) {
    rows[i] = OutPixelAt(g, m0 + tid / kWordDepth + kRowsPerPass * i);
  }
  int acc[kMicro][kMicro] = {};
  const int depth = g.taps * g.words;
  for (int k0 = 0; k0 < depth; k0 += kWordDepth) {
    const PackedRow r = PackedRowAt(g, k0 + tid % kWordDepth);
#pragma unroll
    for (int i = 0; i < kWordLoads; ++i) {
      as[tid % kWordDepth][tid / kWordDepth + kRowsPerPass * i] =
          PackedIm2ColWord(g, xbits, rows[i], r);
      const int kk = tid / kTile + (kThreads / kTile) * i;
      bs[kk][tid % kTile] =
          PackedWeightWord(g, wbits, k0 + kk, n0 + tid % kTile);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kWordDepth; ++kk) {
      uint32_t av[kMicro], bv[kMicro];
#pragma unroll
      for (int i = 0; i < kMicro; ++i) av[i] = as[kk][ty + kLanes * i];
#pragma unroll
      for (int j = 0; j < kMicro; ++j) bv[j] = bs[kk][tx + kLanes * j];
#pragma unroll
      for (int i = 0; i < kMicro; ++i) {
#pragma unroll
        for (int j = 0; j < kMicro; ++j) acc[i][j] += __popc(av[i] ^ bv[j]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kMicro; ++i) {
    const int p = m0 + ty + kLanes * i;
    const OutPixel px = OutPixelAt(g, p);
    if (!px.valid) continue;
#pragma unroll
    for (int j = 0; j < kMicro; ++j) {
      const int o = n0 + tx + kLanes * j;
      if (o >= g.out_c) continue;
      y[p * g.out_c + o] =
          FromFloat<T>(alpha[o] * BinaryDotEpilogue(g, wpop, px, o, acc[i][j]));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    FloatInputForwardKernel(Geom g, const T* x, const T* w, const float* alpha,
                            T* y) {
  __shared__ float as[kDepth][kTile];
  __shared__ float bs[kDepth][kTile];
  const int tid = threadIdx.x, tx = tid % kLanes, ty = tid / kLanes;
  const int m0 = blockIdx.x * kTile, n0 = blockIdx.y * kTile;
  OutPixel rows[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    rows[i] = OutPixelAt(g, m0 + tid / kDepth + (kThreads / kDepth) * i);
  }
  float acc[kMicro][kMicro] = {};
  for (int k0 = 0; k0 < g.filter_k; k0 += kDepth) {
    const FilterRow f = FilterRowAt(g, k0 + tid % kDepth);
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      as[tid % kDepth][tid / kDepth + (kThreads / kDepth) * i] =
          Im2ColValue(g, x, /*binary=*/false, rows[i], f);
      const int kk = tid / kTile + (kThreads / kTile) * i;
      bs[kk][tid % kTile] = SignWeight(g, w, k0 + kk, n0 + tid % kTile);
    }
    __syncthreads();
    AccumulateTile(as, bs, tx, ty, acc);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kMicro; ++i) {
    const int p = m0 + ty + kLanes * i;
    if (p >= g.out_pix) continue;
#pragma unroll
    for (int j = 0; j < kMicro; ++j) {
      const int o = n0 + tx + kLanes * j;
      if (o < g.out_c) y[p * g.out_c + o] = FromFloat<T>(acc[i][j] * alpha[o]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    BackpropInputKernel(Geom g, const T* x, const T* w, const T* dy,
                        const float* alpha, Estimator act_est, float clip,
                        T* dx) {
  __shared__ float as[kDepth][kTile];
  __shared__ float bs[kDepth][kTile];
  const int tid = threadIdx.x, tx = tid % kLanes, ty = tid / kLanes;
  const int m0 = blockIdx.x * kTile, n0 = blockIdx.y * kTile;
  InPixel rows[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    rows[i] = InPixelAt(g, m0 + tid / kDepth + (kThreads / kDepth) * i);
  }
  float acc[kMicro][kMicro] = {};
  const int depth = g.taps * g.out_c;
  for (int k0 = 0; k0 < depth; k0 += kDepth) {
    const DyColumn col = DyColumnAt(g, k0 + tid % kDepth);
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      as[tid % kDepth][tid / kDepth + (kThreads / kDepth) * i] =
          DyGatherValue(g, dy, rows[i], col);
      const int kk = tid / kTile + (kThreads / kTile) * i;
      bs[kk][tid % kTile] = ScaledSignWeightT(
          g, w, alpha, DyColumnAt(g, k0 + kk), n0 + tid % kTile);
    }
    __syncthreads();
    AccumulateTile(as, bs, tx, ty, acc);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kMicro; ++i) {
    const int q = m0 + ty + kLanes * i;
    if (q >= g.in_pix) continue;
#pragma unroll
    for (int j = 0; j < kMicro; ++j) {
      const int c = n0 + tx + kLanes * j;
      if (c >= g.in_c) continue;
      const int idx = q * g.in_c + c;
      dx[idx] =
          FromFloat<T>(BackpropInputEpilogue(x, idx, act_est, clip, acc[i][j]));
    }
  }
}

// One split (blockIdx.z) of dw's pixel reduction into partial[z, K, out_c].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    BackpropFilterKernel(Geom g, const T* x, const T* dy, bool binary,
                         int splits, float* partial) {
  __shared__ float as[kDepth][kTile];
  __shared__ float bs[kDepth][kTile];
  const int tid = threadIdx.x, tx = tid % kLanes, ty = tid / kLanes;
  const int m0 = blockIdx.x * kTile, n0 = blockIdx.y * kTile;
  int begin, end;
  SplitRange(g.out_pix, splits, kDepth, blockIdx.z, &begin, &end);
  const FilterRow f = FilterRowAt(g, m0 + tid % kTile);
  float acc[kMicro][kMicro] = {};
  for (int p0 = begin; p0 < end; p0 += kDepth) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int kk = tid / kTile + (kThreads / kTile) * i;
      const int p = p0 + kk;
      const OutPixel px = p < end ? OutPixelAt(g, p) : OutPixel{0, 0, 0, false};
      as[kk][tid % kTile] = Im2ColValue(g, x, binary, px, f);
      bs[kk][tid % kTile] =
          p < end ? DyValue(g, dy, p, n0 + tid % kTile) : 0.0f;
    }
    __syncthreads();
    AccumulateTile(as, bs, tx, ty, acc);
    __syncthreads();
  }
  float* out = partial + blockIdx.z * g.filter_k * g.out_c;
#pragma unroll
  for (int i = 0; i < kMicro; ++i) {
    const int k = m0 + ty + kLanes * i;
    if (k >= g.filter_k) continue;
#pragma unroll
    for (int j = 0; j < kMicro; ++j) {
      const int o = n0 + tx + kLanes * j;
      if (o < g.out_c) out[k * g.out_c + o] = acc[i][j];
    }
  }
}

template <typename T>
__global__ void ReduceFilterKernel(Geom g, const float* partial, int splits,
                                   const T* w, const float* alpha,
                                   Estimator w_est, float clip, T* dw) {
  const int total = g.filter_k * g.out_c;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    float sum = 0.0f;
    for (int z = 0; z < splits; ++z) sum += partial[z * total + i];
    const float e = EstimatorGradF(w_est, ToFloat(w[i]), clip);
    dw[i] = FromFloat<T>(sum * (alpha[i % g.out_c] * e));
  }
}

// ---------------------------------------------------------------------------
// Launchers.

dim3 TileGrid(int rows, int cols, int splits = 1) {
  return dim3(CeilDiv(rows, kTile), CeilDiv(cols, kTile), splits);
}

template <typename T>
void LaunchAlpha(const Geom& g, const T* w, Scale scale, float* alpha,
                 cudaStream_t stream) {
  AlphaKernel<T><<<CeilDiv(g.out_c, 32), dim3(32, kAlphaRows), 0, stream>>>(
      g, w, scale, alpha);
}

template <typename T>
const char* Forward(const ConvShape& s, const T* x, const T* w,
                    bool binary_input, Scale scale, T* y, void* workspace,
                    cudaStream_t stream) {
  const Geom g = MakeGeom(s);
  if (g.out_pix == 0) return nullptr;
  const PackedBuffers b = Carve(g, workspace);
  LaunchAlpha(g, w, scale, b.alpha, stream);
  if (TensorCoresUsable(g)) {
    return TcForward(g, x, w, binary_input, b.alpha, y,
                     static_cast<char*>(workspace) + AlphaBytes(g), stream);
  }
  if (binary_input) {
    PackInputKernel<T>
        <<<GridFor(g.in_pix * g.words), kThreads, 0, stream>>>(g, x, b.xbits);
    PackFilterKernel<T><<<GridFor(g.taps * g.out_c), kThreads, 0, stream>>>(
        g, w, b.wbits, b.wpop);
    BinaryInputForwardKernel<T>
        <<<TileGrid(g.out_pix, g.out_c), kThreads, 0, stream>>>(
            g, b.xbits, b.wbits, b.wpop, b.alpha, y);
  } else {
    FloatInputForwardKernel<T>
        <<<TileGrid(g.out_pix, g.out_c), kThreads, 0, stream>>>(g, x, w,
                                                                b.alpha, y);
  }
  return LaunchStatus();
}

template <typename T>
const char* BackpropInput(const ConvShape& s, const T* x, const T* w,
                          const T* dy, Estimator act_est, float clip,
                          Scale scale, T* dx, void* workspace,
                          cudaStream_t stream) {
  const Geom g = MakeGeom(s);
  if (g.in_pix == 0) return nullptr;
  float* alpha = static_cast<float*>(workspace);
  LaunchAlpha(g, w, scale, alpha, stream);
  if (TensorCoresUsable(g)) {
    return TcBackpropInput(g, x, w, dy, alpha, act_est, clip, dx,
                           static_cast<char*>(workspace) + AlphaBytes(g),
                           stream);
  }
  BackpropInputKernel<T><<<TileGrid(g.in_pix, g.in_c), kThreads, 0, stream>>>(
      g, x, w, dy, alpha, act_est, clip, dx);
  return LaunchStatus();
}

template <typename T>
const char* BackpropFilter(const ConvShape& s, const T* x, const T* w,
                           const T* dy, Estimator act_est, Estimator w_est,
                           float clip, Scale scale, T* dw, void* workspace,
                           cudaStream_t stream) {
  const Geom g = MakeGeom(s);
  const bool tensor_cores = TensorCoresUsable(g);
  const int splits = tensor_cores ? TcFilterSplits(g) : FilterSplits(g);
  float* alpha = static_cast<float*>(workspace);
  float* partial =
      reinterpret_cast<float*>(static_cast<char*>(workspace) + AlphaBytes(g));
  LaunchAlpha(g, w, scale, alpha, stream);
  const bool binary = act_est != Estimator::kNone;
  if (tensor_cores) {
    const char* err = TcBackpropFilterPartials(
        g, x, dy, binary, partial,
        reinterpret_cast<char*>(partial) + PartialBytes(g, splits), stream);
    if (err) return err;
  } else {
    BackpropFilterKernel<T>
        <<<TileGrid(g.filter_k, g.out_c, splits), kThreads, 0, stream>>>(
            g, x, dy, binary, splits, partial);
  }
  ReduceFilterKernel<T><<<GridFor(g.filter_k * g.out_c), kThreads, 0, stream>>>(
      g, partial, splits, w, alpha, w_est, clip, dw);
  return LaunchStatus();
}

// Runs fn(T*) with the element type of `dtype`.
template <typename Fn>
const char* WithDType(DType dtype, Fn fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(float());
    case DType::kFloat16:
      return fn(__half());
  }
  return "tapehook CUDA binary conv: unknown dtype";
}

}  // namespace

// Workspaces hold either kernel family's buffers: they depend on the shape
// only, not on the device a call will run on.
size_t ForwardWorkspaceBytes(const ConvShape& s, bool binary_input) {
  const Geom g = MakeGeom(s);
  const size_t cuda_cores =
      binary_input ? XBitsBytes(g) + WBitsBytes(g) + WPopBytes(g) : 0;
  return AlphaBytes(g) +
         std::max(cuda_cores, AlignUp(TcForwardBytes(g, binary_input)));
}

size_t BackpropInputWorkspaceBytes(const ConvShape& s) {
  const Geom g = MakeGeom(s);
  return AlphaBytes(g) + AlignUp(TcBackpropInputBytes(g));
}

size_t BackpropFilterWorkspaceBytes(const ConvShape& s) {
  const Geom g = MakeGeom(s);
  return AlphaBytes(g) + std::max(PartialBytes(g, FilterSplits(g)),
                                  PartialBytes(g, TcFilterSplits(g)) +
                                      AlignUp(TcBackpropFilterBytes(g)));
}

const char* BinaryConv2DForward(DType dtype, const ConvShape& s, const void* x,
                                const void* w, bool binary_input, Scale scale,
                                void* y, void* workspace, CUstream_st* stream) {
  if (const char* err = CheckSizes(s)) return err;
  return WithDType(dtype, [&](auto zero) {
    using T = decltype(zero);
    return Forward(s, static_cast<const T*>(x), static_cast<const T*>(w),
                   binary_input, scale, static_cast<T*>(y), workspace, stream);
  });
}

const char* BinaryConv2DBackpropInput(DType dtype, const ConvShape& s,
                                      const void* x, const void* w,
                                      const void* dy, Estimator act_est,
                                      float clip, Scale scale, void* dx,
                                      void* workspace, CUstream_st* stream) {
  if (const char* err = CheckSizes(s)) return err;
  return WithDType(dtype, [&](auto zero) {
    using T = decltype(zero);
    return BackpropInput(s, static_cast<const T*>(x), static_cast<const T*>(w),
                         static_cast<const T*>(dy), act_est, clip, scale,
                         static_cast<T*>(dx), workspace, stream);
  });
}

const char* BinaryConv2DBackpropFilter(DType dtype, const ConvShape& s,
                                       const void* x, const void* w,
                                       const void* dy, Estimator act_est,
                                       Estimator w_est, float clip, Scale scale,
                                       void* dw, void* workspace,
                                       CUstream_st* stream) {
  if (const char* err = CheckSizes(s)) return err;
  return WithDType(dtype, [&](auto zero) {
    using T = decltype(zero);
    return BackpropFilter(s, static_cast<const T*>(x), static_cast<const T*>(w),
                          static_cast<const T*>(dy), act_est, w_est, clip,
                          scale, static_cast<T*>(dw), workspace, stream);
  });
}

}  // namespace cuda
}  // namespace tapehook
