// Tensor-core implicit GEMMs of the CUDA binary Conv2D (sm_80+: bf16
// mma.sync m16n8k16 with float32 accumulation, and int8 m16n8k32 with int32
// accumulation for the fully binary forward; fragments read with ldmatrix,
// transposed by ldmatrix.trans where a tile is stored the other way).
// Operands are staged first (tc_tiles.h); each GEMM then streams 16-byte
// segments of them into shared memory with cp.async (kStages deep), one
// 128 x BN output tile per 256-thread block, each of the 8 warps owning
// 32 x BN/2 as 2 x BN/16 m16n8 accumulators.
//   forward:         A = staged x [out_pix, taps * cp] (im2col by segment)
//                    B = staged sign(W) [taps * cp, op]
//   binary forward:  A = staged sign(x) int8 [out_pix, taps * cq]
//                    B = staged sign(W) int8, k-contiguous [taps, out_c, cq]
//   backprop input:  A = staged dy * alpha [in_pix, taps * op] (gathered)
//                    B = staged sign(W)^T [taps * op, cp]
//   backprop filter: A = staged x^T [taps * cp, pixels] per pixel split
//                    B = staged dy [pixels, op]
// Float operands have a hi and a lo plane; the other operand is then a sign
// (exact in bf16), so hi*s + lo*s is the float product to 2^-17, except
// float-input BackpropFilter: x_hi*dy_hi + x_hi*dy_lo + x_lo*dy_hi.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <climits>

#include "cuda/binary_conv_cuda.h"
#include "cuda/tc_conv.h"
#include "cuda/tc_tiles.h"

namespace tapehook {
namespace cuda {

namespace {

std::atomic<int> g_level{2};  // SetTensorCoreKernels

using Bf16 = __nv_bfloat16;

constexpr int kThreads = 256;  // 8 warps: 4 along M x 2 along N
constexpr int kBM = 128;       // output tile rows
constexpr int kBK = 32;        // reduction step (elements) per stage
constexpr int kSkew = 8;       // shared rows padded by one segment
constexpr int kStages = 3;     // cp.async pipeline depth
constexpr size_t kAlign = 256;

// Products a GEMM sums (A plane, B plane).
constexpr int kHiHi = 1, kLoHi = 2, kHiLo = 4;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
TAPEHOOK_HD int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// Shared-memory tile geometry of one operand plane.
//   A row-major [kBM][kBK + kSkew]   A col-major [kBK][kBM + kSkew]
//   B row-major [kBK][BN + kSkew]    B col-major [BN][kBK + kSkew]
template <int BN, bool kACol, bool kBCol>
struct Layout {
  static constexpr int kAPitch = kACol ? kBM + kSkew : kBK + kSkew;
  static constexpr int kBPitch = kBCol ? kBK + kSkew : BN + kSkew;
  static constexpr int kAPlane = kACol ? kBK * kAPitch : kBM * kAPitch;
  static constexpr int kBPlane = kBCol ? BN * kBPitch : kBK * kBPitch;
  static constexpr int kCPitch = BN + 4;
};

// A warp's accumulators: 2 (m16) x BN/16 (n8) mma fragments of 4 values
// (float for the bf16 GEMMs, int for the int8 one): c[0], c[1] at (row
// lane / 4, columns 2 (lane % 4) + {0, 1}), c[2], c[3] 8 rows below.
template <int BN, typename A = float>
struct Accum {
  A c[2][BN / 16][4];
};

template <int BN, int NA, int NB, bool kACol, bool kBCol>
constexpr size_t SharedBytes() {
  using L = Layout<BN, kACol, kBCol>;
  const size_t stages =
      kStages * (NA * L::kAPlane + NB * L::kBPlane) * sizeof(Bf16);
  const size_t c = size_t(kBM) * L::kCPitch * sizeof(float);
  return stages > c ? stages : c;
}

__device__ __forceinline__ void CpAsync16(Bf16* dst, const void* src,
                                          bool valid) {
#if __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
               "l"(src), "r"(valid ? 16 : 0));
#endif
}

__device__ __forceinline__ void CpAsyncCommit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void CpAsyncWait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Copies segment `off` (-1: zeros; in elements E of the staged array) of
// every plane into its shared slot (16 bytes whatever E is).
template <int NP, typename E>
__device__ __forceinline__ void CopySegment(const E* const* src, Bf16* dst,
                                            int plane, int off) {
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    CpAsync16(dst + p * plane, off >= 0 ? src[p] + off : src[p], off >= 0);
  }
}

__device__ __forceinline__ unsigned SharedAddress(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lanes 8 j .. 8 j + 7 give the row addresses of
// matrix j, register j receives it (transposed with kTrans).
template <bool kTrans>
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], unsigned addr) {
#if __CUDA_ARCH__ >= 800
  if (kTrans) {
    asm volatile(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, "
        "[%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr));
  } else {
    asm volatile(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(addr));
  }
#endif
}

__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4],
                                    uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The int8 product: k32 per instruction, in the same registers and shared
// bytes as a bf16 k16 step (16 bytes of k per fragment row).
__device__ __forceinline__ void Mma(int (&c)[4], const uint32_t (&a)[4],
                                    uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// One stage's kBK-deep slice of the warp's 32 x BN/2 tile. A fragment
// (m16 x k16) registers: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15),
// (m 8-15, k 8-15); B (k16 x n8): (k 0-7), (k 8-15); one ldmatrix.x4 reads
// an A fragment or two n8 B fragments.
template <int BN, int NA, int NB, bool kACol, bool kBCol, int kProducts,
          typename AccT>
__device__ __forceinline__ void ComputeStage(const Bf16* a, const Bf16* b,
                                             int wm, int wn,
                                             Accum<BN, AccT>& acc) {
  using L = Layout<BN, kACol, kBCol>;
  constexpr int kN8 = BN / 16;
  const int lane = threadIdx.x % 32, j8 = lane / 8, r8 = lane % 8;
  const unsigned a0 = SharedAddress(a), b0 = SharedAddress(b);
#pragma unroll
  for (int kk = 0; kk < kBK; kk += 16) {
    uint32_t fa[NA][2][4], fb[NB][kN8][2];
#pragma unroll
    for (int p = 0; p < NA; ++p) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int m = wm * 32 + 16 * i;
        // Stored [k][m] (col-major): transposed rows of k.
        const int off =
            kACol ? (kk + r8 + 8 * (j8 / 2)) * L::kAPitch + m + 8 * (j8 % 2)
                  : (m + lane % 16) * L::kAPitch + kk + 8 * (lane / 16);
        LdMatrixX4<kACol>(fa[p][i], a0 + (p * L::kAPlane + off) * sizeof(Bf16));
      }
    }
#pragma unroll
    for (int p = 0; p < NB; ++p) {
#pragma unroll
      for (int jj = 0; jj < kN8 / 2; ++jj) {
        const int n = wn * (BN / 2) + 16 * jj;
        // Stored [n][k] (col-major) as mma wants it; [k][n] transposed.
        const int off =
            kBCol ? (n + r8 + 8 * (j8 / 2)) * L::kBPitch + kk + 8 * (j8 % 2)
                  : (kk + r8 + 8 * (j8 % 2)) * L::kBPitch + n + 8 * (j8 / 2);
        uint32_t r[4];
        LdMatrixX4<!kBCol>(r, b0 + (p * L::kBPlane + off) * sizeof(Bf16));
        fb[p][2 * jj][0] = r[0], fb[p][2 * jj][1] = r[1];
        fb[p][2 * jj + 1][0] = r[2], fb[p][2 * jj + 1][1] = r[3];
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < kN8; ++j) {
        if (kProducts & kLoHi) {
          Mma(acc.c[i][j], fa[NA - 1][i], fb[0][j][0], fb[0][j][1]);
        }
        if (kProducts & kHiLo) {
          Mma(acc.c[i][j], fa[0][i], fb[NB - 1][j][0], fb[NB - 1][j][1]);
        }
        if (kProducts & kHiHi) {
          Mma(acc.c[i][j], fa[0][i], fb[0][j][0], fb[0][j][1]);
        }
      }
    }
  }
}

// The pipelined main loop over `chunks` reduction steps; load(a, b) issues
// the cp.async copies of the next step (it is called once per step, in
// order) into a stage's A and B planes.
// kStages - 1 steps are in flight while one is multiplied (one commit group
// per step, empty past the end, so wait_group counts steps). Leaves the
// accumulators in acc and shared memory free for the epilogue.
template <int BN, int NA, int NB, bool kACol, bool kBCol, int kProducts,
          class Load, typename AccT>
__device__ __forceinline__ void MainLoop(Bf16* smem, int chunks,
                                         const Load& load,
                                         Accum<BN, AccT>& acc) {
  using L = Layout<BN, kACol, kBCol>;
  const int warp = threadIdx.x / 32, wm = warp % 4, wn = warp / 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc.c[i][j][e] = 0;
    }
  }
  constexpr int kStage = NA * L::kAPlane + NB * L::kBPlane;
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) {
    if (c < chunks)
      load(smem + c * kStage, smem + c * kStage + NA * L::kAPlane);
    CpAsyncCommit();
  }
  for (int c = 0; c < chunks; ++c) {
    CpAsyncWait<kStages - 2>();  // step c has landed (this thread's copies)
    __syncthreads();  // everyone's copies; stage (c - 1) % kStages is free
    const int next = c + kStages - 1;
    if (next < chunks) {
      Bf16* st = smem + (next % kStages) * kStage;
      load(st, st + NA * L::kAPlane);
    }
    CpAsyncCommit();
    const Bf16* cur = smem + (c % kStages) * kStage;
    ComputeStage<BN, NA, NB, kACol, kBCol, kProducts>(
        cur, cur + NA * L::kAPlane, wm, wn, acc);
  }
  CpAsyncWait<0>();
  __syncthreads();
}

// Writes the block's accumulators to shared memory as [kBM][kCPitch] floats
// and calls store(row, col, value) for each of the tile's elements, columns
// fastest (coalesced global stores).
template <int BN, bool kACol, bool kBCol, class Store, typename AccT>
__device__ __forceinline__ void Epilogue(Bf16* smem, const Accum<BN, AccT>& acc,
                                         const Store& store) {
  using L = Layout<BN, kACol, kBCol>;
  float* cs = reinterpret_cast<float*>(smem);
  const int warp = threadIdx.x / 32, wm = warp % 4, wn = warp / 4;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < BN / 16; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = wm * 32 + 16 * i + lane / 4 + 8 * (e / 2);
        const int col = wn * (BN / 2) + 8 * j + 2 * (lane % 4) + e % 2;
        cs[row * L::kCPitch + col] = float(acc.c[i][j][e]);  // int: exact
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kBM * BN; idx += kThreads) {
    const int r = idx / BN, col = idx % BN;
    store(r, col, cs[r * L::kCPitch + col]);
  }
}

// ---------------------------------------------------------------------------
// GEMM kernels.

// Issues the copies of one R x S (segments) operand tile: thread-constant
// (row, segment) pairs idx = threadIdx.x + kThreads * i, off(i, row, seg)
// the staged offset of each (-1: zeros).
template <int R, int S, int NP, typename E, class Off>
__device__ __forceinline__ void LoadTile(const E* const* src, Bf16* dst,
                                         int pitch, int plane, const Off& off) {
  static_assert(R * S % kThreads == 0, "whole passes only");
#pragma unroll
  for (int i = 0; i < R * S / kThreads; ++i) {
    const int idx = threadIdx.x + kThreads * i, r = idx / S, s = idx % S;
    CopySegment<NP>(src, dst + r * pitch + s * kTcSegment, plane, off(i, r, s));
  }
}

// Row-major A tiles (forward, backprop input): kBM rows of kASegs segments,
// kARowLoads of them per thread, each thread's rows fixed for the block.
constexpr int kASegs = kBK / kTcSegment;             // 4
constexpr int kARowLoads = kBM * kASegs / kThreads;  // 2
__device__ __forceinline__ int ARow(int i) {
  return (threadIdx.x + kThreads * i) / kASegs;
}

template <int BN, int NA, typename T>
__global__ void __launch_bounds__(kThreads, 2)
    TcForwardKernel(TcGeom t, const Bf16* x0, const Bf16* x1, const Bf16* ws,
                    const float* alpha, T* y) {
#if __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Bf16* smem = reinterpret_cast<Bf16*>(smem_raw);
  using L = Layout<BN, false, false>;
  const Geom& g = t.g;
  const int m0 = blockIdx.x * kBM, n0 = blockIdx.y * BN;
  OutPixel px[kARowLoads];
#pragma unroll
  for (int i = 0; i < kARowLoads; ++i) px[i] = OutPixelAt(g, m0 + ARow(i));
  const Bf16* const xs[2] = {x0, x1};
  TapWalk walk;
  auto load = [&](Bf16* a, Bf16* b) {
    LoadTile<kBM, kASegs, NA>(xs, a, L::kAPitch, L::kAPlane,
                              [&](int i, int, int s) {
                                return TcForwardA(t, px[i], walk.dh, walk.dw,
                                                  walk.k0 + s * kTcSegment);
                              });
    LoadTile<kBK, BN / kTcSegment, 1>(
        &ws, b, L::kBPitch, L::kBPlane, [&](int, int r, int s) {
          return TcFilter(t, walk.tap, walk.k0 + r, n0 + s * kTcSegment);
        });
    walk.Next(g, kBK, t.cp);
  };
  Accum<BN> acc;
  MainLoop<BN, NA, 1, false, false, NA == 2 ? kHiHi | kLoHi : kHiHi>(
      smem, g.taps * CeilDiv(t.cp, kBK), load, acc);
  Epilogue<BN, false, false>(smem, acc, [&](int r, int col, float v) {
    const int p = m0 + r, o = n0 + col;
    if (p < g.out_pix && o < g.out_c) {
      y[p * g.out_c + o] = FromFloat<T>(v * alpha[o]);
    }
  });
#endif
}

// The fully binary forward on int8: A = staged sign(x) [in_pix, cq], B =
// staged sign(W) [taps, out_c, cq] read as k-contiguous columns; kBK bf16
// of a stage row are 2 kBK int8 channels. The int32 sums are exact.
template <int BN, typename T>
__global__ void __launch_bounds__(kThreads, 2)
    TcForwardInt8Kernel(TcGeom t, const int8_t* xs, const int8_t* wt,
                        const float* alpha, T* y) {
#if __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Bf16* smem = reinterpret_cast<Bf16*>(smem_raw);
  using L = Layout<BN, false, true>;
  constexpr int kDepth8 = 2 * kBK;  // int8 channels per step
  const Geom& g = t.g;
  const int m0 = blockIdx.x * kBM, n0 = blockIdx.y * BN;
  OutPixel px[kARowLoads];
#pragma unroll
  for (int i = 0; i < kARowLoads; ++i) px[i] = OutPixelAt(g, m0 + ARow(i));
  TapWalk walk;
  auto load = [&](Bf16* a, Bf16* b) {
    LoadTile<kBM, kASegs, 1>(&xs, a, L::kAPitch, L::kAPlane,
                             [&](int i, int, int s) {
                               return TcForwardA8(t, px[i], walk.dh, walk.dw,
                                                  walk.k0 + s * kTcSegment8);
                             });
    // B col-major: row = output channel, segments along c.
    LoadTile<BN, kASegs, 1>(
        &wt, b, L::kBPitch, L::kBPlane, [&](int, int r, int s) {
          return TcFilterT8(t, walk.tap, n0 + r, walk.k0 + s * kTcSegment8);
        });
    walk.Next(g, kDepth8, t.cq);
  };
  Accum<BN, int> acc;
  MainLoop<BN, 1, 1, false, true, kHiHi>(smem, g.taps * CeilDiv(t.cq, kDepth8),
                                         load, acc);
  Epilogue<BN, false, true>(smem, acc, [&](int r, int col, float v) {
    const int p = m0 + r, o = n0 + col;
    if (p < g.out_pix && o < g.out_c) {
      y[p * g.out_c + o] = FromFloat<T>(v * alpha[o]);
    }
  });
#endif
}

template <int BN, typename T>
__global__ void __launch_bounds__(kThreads, 2)
    TcBackpropInputKernel(TcGeom t, const Bf16* dy0, const Bf16* dy1,
                          const Bf16* ws, const T* x, Estimator act_est,
                          float clip, T* dx) {
#if __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Bf16* smem = reinterpret_cast<Bf16*>(smem_raw);
  using L = Layout<BN, false, true>;
  const Geom& g = t.g;
  const int m0 = blockIdx.x * kBM, n0 = blockIdx.y * BN;
  InPixel q[kARowLoads];
#pragma unroll
  for (int i = 0; i < kARowLoads; ++i) q[i] = InPixelAt(g, m0 + ARow(i));
  const Bf16* const dys[2] = {dy0, dy1};
  TapWalk walk;
  auto load = [&](Bf16* a, Bf16* b) {
    LoadTile<kBM, kASegs, 2>(
        dys, a, L::kAPitch, L::kAPlane, [&](int i, int, int s) {
          return TcBackpropInputA(t, q[i], walk.dh, walk.dw,
                                  walk.k0 + s * kTcSegment);
        });
    // B col-major: row = input channel, segments along o.
    LoadTile<BN, kASegs, 1>(
        &ws, b, L::kBPitch, L::kBPlane, [&](int, int r, int s) {
          return TcFilter(t, walk.tap, n0 + r, walk.k0 + s * kTcSegment);
        });
    walk.Next(g, kBK, t.op);
  };
  Accum<BN> acc;
  MainLoop<BN, 2, 1, false, true, kHiHi | kLoHi>(
      smem, g.taps * CeilDiv(t.op, kBK), load, acc);
  Epilogue<BN, false, true>(smem, acc, [&](int r, int col, float v) {
    const int qi = m0 + r, c = n0 + col;
    if (qi < g.in_pix && c < g.in_c) {
      const int idx = qi * g.in_c + c;
      dx[idx] = FromFloat<T>(BackpropInputEpilogue(x, idx, act_est, clip, v));
    }
  });
#endif
}

// Split blockIdx.z of the pixel reduction into partial[z, filter_k, out_c].
template <int BN, int NA>
__global__ void __launch_bounds__(kThreads, 2)
    TcBackpropFilterKernel(TcGeom t, const Bf16* x0, const Bf16* x1,
                           const Bf16* dy0, const Bf16* dy1, int splits,
                           float* partial) {
#if __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Bf16* smem = reinterpret_cast<Bf16*>(smem_raw);
  using L = Layout<BN, true, false>;
  const Geom& g = t.g;
  const int m0 = blockIdx.x * kBM, n0 = blockIdx.y * BN;
  int begin, end;
  SplitRange(g.out_pix, splits, kBK, blockIdx.z, &begin, &end);
  const Bf16* const xs[2] = {x0, x1};
  const Bf16* const dys[2] = {dy0, dy1};
  int p0 = begin;
  auto load = [&](Bf16* a, Bf16* b) {
    // A col-major: row = pixel, segments along the filter rows m.
    LoadTile<kBK, kBM / kTcSegment, NA>(
        xs, a, L::kAPitch, L::kAPlane, [&](int, int r, int s) {
          const int p = p0 + r;
          const OutPixel px =
              p < end ? OutPixelAt(g, p) : OutPixel{0, 0, 0, false};
          return TcBackpropFilterA(t, px, m0 + s * kTcSegment);
        });
    LoadTile<kBK, BN / kTcSegment, 2>(
        dys, b, L::kBPitch, L::kBPlane, [&](int, int r, int s) {
          return TcDy(t, p0 + r, p0 + r < end, n0 + s * kTcSegment);
        });
    p0 += kBK;
  };
  Accum<BN> acc;
  MainLoop<BN, NA, 2, true, false,
           NA == 2 ? kHiHi | kHiLo | kLoHi : kHiHi | kHiLo>(
      smem, CeilDiv(end - begin, kBK), load, acc);
  float* out = partial + size_t(blockIdx.z) * g.filter_k * g.out_c;
  Epilogue<BN, true, false>(smem, acc, [&](int r, int col, float v) {
    const int row = TcFilterRow(t, m0 + r), o = n0 + col;
    if (row >= 0 && o < g.out_c) out[row * g.out_c + o] = v;
  });
#endif
}

// ---------------------------------------------------------------------------
// Staging kernels (memory bound, grid-stride).

int GridFor(long long total) {
  return int(
      std::max(1LL, std::min((total + kThreads - 1) / kThreads, 8192LL)));
}

// The staging kernels take one 16-byte segment of a stage per thread (pitch
// is a multiple of kTcSegment) and store it whole.
struct alignas(16) StagedSegment {
  Bf16 v[kTcSegment];
};

// [rows, cols] -> hi and lo planes [rows, pitch].
template <typename T>
__global__ void StageFloatKernel(const T* src, int rows, int cols, int pitch,
                                 const float* scale, Bf16* hi, Bf16* lo) {
  const int segs = pitch / kTcSegment, total = rows * segs;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    const int r = i / segs, c0 = (i % segs) * kTcSegment;
    StagedSegment h, l;
#pragma unroll
    for (int e = 0; e < kTcSegment; ++e) {
      SplitBf16(StagedValue(src, cols, scale, r, c0 + e), &h.v[e], &l.v[e]);
    }
    reinterpret_cast<StagedSegment*>(hi)[i] = h;
    reinterpret_cast<StagedSegment*>(lo)[i] = l;
  }
}

template <typename T>
__global__ void StageSignKernel(const T* src, int rows, int cols, int pitch,
                                Bf16* out) {
  const int segs = pitch / kTcSegment, total = rows * segs;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    const int r = i / segs, c0 = (i % segs) * kTcSegment;
    StagedSegment v;
#pragma unroll
    for (int e = 0; e < kTcSegment; ++e) {
      v.v[e] = __float2bfloat16_rn(StagedSign(src, cols, r, c0 + e));
    }
    reinterpret_cast<StagedSegment*>(out)[i] = v;
  }
}

// sign(x) [rows, cols] -> int8 [rows, pitch8], 16 channels per thread.
template <typename T>
__global__ void StageSign8Kernel(const T* src, int rows, int cols, int pitch8,
                                 int8_t* out) {
  const int segs = pitch8 / kTcSegment8, total = rows * segs;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    const int r = i / segs, c0 = (i % segs) * kTcSegment8;
    alignas(16) int8_t v[kTcSegment8];
#pragma unroll
    for (int e = 0; e < kTcSegment8; ++e) {
      v[e] = int8_t(StagedSign(src, cols, r, c0 + e));
    }
    reinterpret_cast<uint4*>(out)[i] = *reinterpret_cast<const uint4*>(v);
  }
}

template <typename T>
__global__ void StageFilterT8Kernel(TcGeom t, const T* w, int8_t* out) {
  const int total = t.g.taps * t.g.out_c * t.cq;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    out[i] = int8_t(StagedFilterSignT(t, w, i));
  }
}

template <typename T>
__global__ void StageFilterKernel(TcGeom t, const T* w, Bf16* out) {
  const int total = t.g.taps * t.cp * t.op;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += gridDim.x * blockDim.x) {
    out[i] = __float2bfloat16_rn(StagedFilterSign(t, w, i));
  }
}

// Workspace carving: aligned bf16 planes one after the other.
struct Carver {
  char* p;
  template <typename E = Bf16>
  E* Take(size_t elems) {
    E* out = reinterpret_cast<E*>(p);
    p += AlignUp(elems * sizeof(E));
    return out;
  }
};

size_t PlaneBytes(long long elems) { return AlignUp(size_t(elems) * 2); }
size_t XPlane(const TcGeom& t) { return PlaneBytes(1LL * t.g.in_pix * t.cp); }
size_t DyPlane(const TcGeom& t) { return PlaneBytes(1LL * t.g.out_pix * t.op); }
size_t WPlane(const TcGeom& t) {
  return PlaneBytes(1LL * t.g.taps * t.cp * t.op);
}

template <typename T>
void StageFloat(const T* src, int rows, int cols, int pitch, const float* scale,
                Bf16* hi, Bf16* lo, cudaStream_t stream) {
  StageFloatKernel<T>
      <<<GridFor(1LL * rows * pitch / kTcSegment), kThreads, 0, stream>>>(
          src, rows, cols, pitch, scale, hi, lo);
}

template <typename T>
void StageSign(const T* src, int rows, int cols, int pitch, Bf16* out,
               cudaStream_t stream) {
  StageSignKernel<T>
      <<<GridFor(1LL * rows * pitch / kTcSegment), kThreads, 0, stream>>>(
          src, rows, cols, pitch, out);
}

template <typename T>
void StageFilter(const TcGeom& t, const T* w, Bf16* out, cudaStream_t stream) {
  StageFilterKernel<T>
      <<<GridFor(1LL * t.g.taps * t.cp * t.op), kThreads, 0, stream>>>(t, w,
                                                                       out);
}

// Launches kernel with its dynamic shared memory (above the 48 KiB default).
template <typename Kernel, typename... Args>
const char* Launch(Kernel kernel, size_t smem, dim3 grid, cudaStream_t stream,
                   Args... args) {
  cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return cudaGetErrorString(err);
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Wide tiles only where the N dimension fills them.
bool Wide(int n) { return n > 64; }

dim3 Grid(int m, int n, int bn, int splits = 1) {
  return dim3(CeilDiv(m, kBM), CeilDiv(n, bn), splits);
}

constexpr int kTargetBlocks = 528;  // ~2 waves of 2 blocks / SM on an H100
constexpr int kMaxSplits = 64;

}  // namespace

void SetTensorCoreKernels(int level) { g_level = level; }

bool TensorCoresUsable(const Geom& g) {
  if (g_level < 1) return false;
  // The staged arrays (channels padded to 16 at most) take 32-bit offsets
  // too; the CUDA-core kernels read the tensors as they are.
  const TcGeom t = MakeTcGeom(g);
  const long long limit = INT_MAX;
  if (1LL * g.in_pix * t.cq >= limit || 1LL * g.out_pix * t.op >= limit ||
      1LL * g.taps * t.cp * t.op >= limit ||
      1LL * g.taps * g.out_c * t.cq >= limit) {
    return false;
  }
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                             device) != cudaSuccess) {
    cudaGetLastError();  // clear, the CUDA-core kernels report it
    return false;
  }
  return major >= 8;
}

int TcFilterSplits(const Geom& g) {
  const TcGeom t = MakeTcGeom(g);
  const int bn = Wide(g.out_c) ? 128 : 64;
  const int tiles = CeilDiv(g.taps * t.cp, kBM) * CeilDiv(g.out_c, bn);
  int splits = CeilDiv(kTargetBlocks, tiles);
  splits = std::min(splits, std::max(1, CeilDiv(g.out_pix, 8 * kBK)));
  splits = std::min(splits, kMaxSplits);
  const long long kn = 1LL * g.filter_k * g.out_c;
  splits = int(std::min<long long>(splits, INT_MAX / std::max(kn, 1LL)));
  return std::max(splits, 1);
}

size_t TcForwardBytes(const Geom& g, bool binary_input) {
  const TcGeom t = MakeTcGeom(g);
  const size_t bf16 = (binary_input ? 1 : 2) * XPlane(t) + WPlane(t);
  if (!binary_input) return bf16;
  const size_t int8 = AlignUp(size_t(g.in_pix) * t.cq) +
                      AlignUp(size_t(g.taps) * g.out_c * t.cq);
  return std::max(bf16, int8);
}

size_t TcBackpropInputBytes(const Geom& g) {
  const TcGeom t = MakeTcGeom(g);
  return 2 * DyPlane(t) + WPlane(t);
}

size_t TcBackpropFilterBytes(const Geom& g) {
  const TcGeom t = MakeTcGeom(g);
  return 2 * XPlane(t) + 2 * DyPlane(t);
}

template <typename T>
const char* TcForward(const Geom& g, const T* x, const T* w, bool binary_input,
                      const float* alpha, T* y, void* workspace,
                      cudaStream_t stream) {
  const TcGeom t = MakeTcGeom(g);
  Carver carve{static_cast<char*>(workspace)};
  if (binary_input && g_level >= 2) {
    int8_t* x8 = carve.Take<int8_t>(size_t(g.in_pix) * t.cq);
    int8_t* w8 = carve.Take<int8_t>(size_t(g.taps) * g.out_c * t.cq);
    StageSign8Kernel<T>
        <<<GridFor(1LL * g.in_pix * t.cq / kTcSegment8), kThreads, 0, stream>>>(
            x, g.in_pix, g.in_c, t.cq, x8);
    StageFilterT8Kernel<T>
        <<<GridFor(1LL * g.taps * g.out_c * t.cq), kThreads, 0, stream>>>(t, w,
                                                                          w8);
    if (Wide(g.out_c)) {
      return Launch(TcForwardInt8Kernel<128, T>,
                    SharedBytes<128, 1, 1, false, true>(),
                    Grid(g.out_pix, g.out_c, 128), stream, t, x8, w8, alpha, y);
    }
    return Launch(TcForwardInt8Kernel<64, T>,
                  SharedBytes<64, 1, 1, false, true>(),
                  Grid(g.out_pix, g.out_c, 64), stream, t, x8, w8, alpha, y);
  }
  Bf16* ws = carve.Take(size_t(g.taps) * t.cp * t.op);
  Bf16* x0 = carve.Take(size_t(g.in_pix) * t.cp);
  StageFilter(t, w, ws, stream);
  if (binary_input) {
    StageSign(x, g.in_pix, g.in_c, t.cp, x0, stream);
    if (Wide(g.out_c)) {
      return Launch(
          TcForwardKernel<128, 1, T>, SharedBytes<128, 1, 1, false, false>(),
          Grid(g.out_pix, g.out_c, 128), stream, t, x0, x0, ws, alpha, y);
    }
    return Launch(
        TcForwardKernel<64, 1, T>, SharedBytes<64, 1, 1, false, false>(),
        Grid(g.out_pix, g.out_c, 64), stream, t, x0, x0, ws, alpha, y);
  }
  Bf16* x1 = carve.Take(size_t(g.in_pix) * t.cp);
  StageFloat(x, g.in_pix, g.in_c, t.cp, nullptr, x0, x1, stream);
  if (Wide(g.out_c)) {
    return Launch(
        TcForwardKernel<128, 2, T>, SharedBytes<128, 2, 1, false, false>(),
        Grid(g.out_pix, g.out_c, 128), stream, t, x0, x1, ws, alpha, y);
  }
  return Launch(TcForwardKernel<64, 2, T>,
                SharedBytes<64, 2, 1, false, false>(),
                Grid(g.out_pix, g.out_c, 64), stream, t, x0, x1, ws, alpha, y);
}

template <typename T>
const char* TcBackpropInput(const Geom& g, const T* x, const T* w, const T* dy,
                            const float* alpha, Estimator act_est, float clip,
                            T* dx, void* workspace, cudaStream_t stream) {
  const TcGeom t = MakeTcGeom(g);
  Carver carve{static_cast<char*>(workspace)};
  Bf16* ws = carve.Take(size_t(g.taps) * t.cp * t.op);
  Bf16* dy0 = carve.Take(size_t(g.out_pix) * t.op);
  Bf16* dy1 = carve.Take(size_t(g.out_pix) * t.op);
  StageFilter(t, w, ws, stream);
  StageFloat(dy, g.out_pix, g.out_c, t.op, alpha, dy0, dy1, stream);
  if (Wide(g.in_c)) {
    return Launch(TcBackpropInputKernel<128, T>,
                  SharedBytes<128, 2, 1, false, true>(),
                  Grid(g.in_pix, g.in_c, 128), stream, t, dy0, dy1, ws, x,
                  act_est, clip, dx);
  }
  return Launch(TcBackpropInputKernel<64, T>,
                SharedBytes<64, 2, 1, false, true>(),
                Grid(g.in_pix, g.in_c, 64), stream, t, dy0, dy1, ws, x, act_est,
                clip, dx);
}

template <typename T>
const char* TcBackpropFilterPartials(const Geom& g, const T* x, const T* dy,
                                     bool binary_input, float* partial,
                                     void* workspace, cudaStream_t stream) {
  const TcGeom t = MakeTcGeom(g);
  const int splits = TcFilterSplits(g);
  Carver carve{static_cast<char*>(workspace)};
  Bf16* x0 = carve.Take(size_t(g.in_pix) * t.cp);
  Bf16* x1 = carve.Take(size_t(g.in_pix) * t.cp);
  Bf16* dy0 = carve.Take(size_t(g.out_pix) * t.op);
  Bf16* dy1 = carve.Take(size_t(g.out_pix) * t.op);
  StageFloat(dy, g.out_pix, g.out_c, t.op, nullptr, dy0, dy1, stream);
  const int rows = g.taps * t.cp;
  if (binary_input) {
    StageSign(x, g.in_pix, g.in_c, t.cp, x0, stream);
    if (Wide(g.out_c)) {
      return Launch(TcBackpropFilterKernel<128, 1>,
                    SharedBytes<128, 1, 2, true, false>(),
                    Grid(rows, g.out_c, 128, splits), stream, t, x0, x0, dy0,
                    dy1, splits, partial);
    }
    return Launch(TcBackpropFilterKernel<64, 1>,
                  SharedBytes<64, 1, 2, true, false>(),
                  Grid(rows, g.out_c, 64, splits), stream, t, x0, x0, dy0, dy1,
                  splits, partial);
  }
  StageFloat(x, g.in_pix, g.in_c, t.cp, nullptr, x0, x1, stream);
  if (Wide(g.out_c)) {
    return Launch(TcBackpropFilterKernel<128, 2>,
                  SharedBytes<128, 2, 2, true, false>(),
                  Grid(rows, g.out_c, 128, splits), stream, t, x0, x1, dy0, dy1,
                  splits, partial);
  }
  return Launch(TcBackpropFilterKernel<64, 2>,
                SharedBytes<64, 2, 2, true, false>(),
                Grid(rows, g.out_c, 64, splits), stream, t, x0, x1, dy0, dy1,
                splits, partial);
}

#define TAPEHOOK_TC_INSTANTIATE(T)                                           \
  template const char* TcForward<T>(const Geom&, const T*, const T*, bool,   \
                                    const float*, T*, void*, cudaStream_t);  \
  template const char* TcBackpropInput<T>(const Geom&, const T*, const T*,   \
                                          const T*, const float*, Estimator, \
                                          float, T*, void*, cudaStream_t);   \
  template const char* TcBackpropFilterPartials<T>(                          \
      const Geom&, const T*, const T*, bool, float*, void*, cudaStream_t);
TAPEHOOK_TC_INSTANTIATE(float)
TAPEHOOK_TC_INSTANTIATE(__half)
#undef TAPEHOOK_TC_INSTANTIATE

}  // namespace cuda
}  // namespace tapehook
