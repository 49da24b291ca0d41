// Index and staging logic of the tensor-core (sm_80+) CUDA binary Conv2D, as
// __host__ __device__ functions: tc_conv.cu's kernels call them, and
// harness/tile_logic_test.cu replays the same GEMMs through them on the host
// against the CPU core.
//
// The tensor-core path stages every operand once per call as bf16 in the
// workspace, channels padded to multiples of 8 (one 16-byte segment), so the
// GEMM loaders copy whole segments (cp.async, zero fill for padding) and
// never convert:
//   signs (sign(x), sign(W)) as one bf16 plane: +-1 and 0 are exact;
//   float operands (x, dy, dy * alpha) as two planes, hi = bf16(v) and
//   lo = bf16(v - hi): hi + lo carries 16 significant bits (every float16
//   exactly; a float32 to within 2^-17 relative), and a product with a sign
//   is exact per plane, so the GEMM sums hi*s + lo*s in float32.
// Segment functions return the element offset of the segment's first element
// in the staged array, or -1 where the segment reads zeros (padding taps,
// channels past the padded count, rows past the matrix).
#ifndef TAPEHOOK_CUDA_TC_TILES_H_
#define TAPEHOOK_CUDA_TC_TILES_H_

#include <cuda_bf16.h>

#include "cuda/conv_tiles.h"

namespace tapehook {
namespace cuda {

constexpr int kTcSegment = 8;  // bf16 elements per 16-byte segment

TAPEHOOK_HD int RoundUpTo(int n, int m) { return (n + m - 1) / m * m; }

constexpr int kTcSegment8 = 16;  // int8 elements per 16-byte segment

// Geom plus the padded channel counts of the staged arrays.
struct TcGeom {
  Geom g;
  int cp;  // in_c rounded up to kTcSegment
  int op;  // out_c rounded up to kTcSegment
  int cq;  // in_c rounded up to kTcSegment8 (int8 stages)
};

inline TcGeom MakeTcGeom(const Geom& g) {
  return {g, RoundUpTo(g.in_c, kTcSegment), RoundUpTo(g.out_c, kTcSegment),
          RoundUpTo(g.in_c, kTcSegment8)};
}

TAPEHOOK_HD int TapDh(const Geom& g, int tap) {
  return (tap / g.k_w) * g.dil_h;
}
TAPEHOOK_HD int TapDw(const Geom& g, int tap) {
  return (tap % g.k_w) * g.dil_w;
}

// ---------------------------------------------------------------------------
// Staging: element (r, c) of a [rows, pitch] stage of a [rows, cols] tensor.

// hi + lo split of v (lo = 0 where hi is not finite, so an infinity stays
// one instead of becoming inf - inf).
TAPEHOOK_HD void SplitBf16(float v, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  const __nv_bfloat16 h = __float2bfloat16_rn(v);
  const float hf = __bfloat162float(h);
  *hi = h;
  // hf - hf is 0 exactly when hf is finite.
  *lo = __float2bfloat16_rn(hf - hf == 0.0f ? v - hf : 0.0f);
}

// The float value staged at (r, c): src * scale[c] (scale may be null), 0
// in the channel padding.
template <typename T>
TAPEHOOK_HD float StagedValue(const T* src, int cols, const float* scale, int r,
                              int c) {
  if (c >= cols) return 0.0f;
  const float v = ToFloat(src[r * cols + c]);
  return scale ? v * scale[c] : v;
}

// sign(src) staged at (r, c), 0 in the channel padding.
template <typename T>
TAPEHOOK_HD float StagedSign(const T* src, int cols, int r, int c) {
  return c < cols ? SignOf(ToFloat(src[r * cols + c])) : 0.0f;
}

// sign(W) staged as [taps, cp, op] from HWIO [taps, in_c, out_c] at element
// i of the stage.
template <typename T>
TAPEHOOK_HD float StagedFilterSign(const TcGeom& t, const T* w, int i) {
  const int o = i % t.op, rest = i / t.op;
  const int c = rest % t.cp, tap = rest / t.cp;
  if (c >= t.g.in_c || o >= t.g.out_c) return 0.0f;
  return SignOf(ToFloat(w[(tap * t.g.in_c + c) * t.g.out_c + o]));
}

// sign(W) staged as int8 [taps, out_c, cq] (each filter column's channels
// contiguous: the fully binary forward's B, k-contiguous) at element i.
template <typename T>
TAPEHOOK_HD float StagedFilterSignT(const TcGeom& t, const T* w, int i) {
  const int c = i % t.cq, rest = i / t.cq;
  const int o = rest % t.g.out_c, tap = rest / t.g.out_c;
  if (c >= t.g.in_c) return 0.0f;
  return SignOf(ToFloat(w[(tap * t.g.in_c + c) * t.g.out_c + o]));
}

// ---------------------------------------------------------------------------
// Segments.

// Forward A [out_pix, taps * cp]: staged x of the input pixel that output
// pixel px reads through the tap at offset (dh, dw) (TapDh, TapDw),
// channels [c, c + 8).
TAPEHOOK_HD int TcForwardA(const TcGeom& t, OutPixel px, int dh, int dw,
                           int c) {
  if (!px.valid || c >= t.cp) return -1;
  const int pix = InputPixelIndex(t.g, px, dh, dw);
  return pix < 0 ? -1 : pix * t.cp + c;
}

// The fully binary forward on int8 (exact: +-1 products summed in int32):
// A = sign(x) staged as int8 [in_pix, cq], segments of 16 channels.
TAPEHOOK_HD int TcForwardA8(const TcGeom& t, OutPixel px, int dh, int dw,
                            int c) {
  if (!px.valid || c >= t.cq) return -1;
  const int pix = InputPixelIndex(t.g, px, dh, dw);
  return pix < 0 ? -1 : pix * t.cq + c;
}

// B = sign(W) staged as int8 [taps, out_c, cq]: filter column o of tap,
// channels [c, c + 16).
TAPEHOOK_HD int TcFilterT8(const TcGeom& t, int tap, int o, int c) {
  if (o >= t.g.out_c || c >= t.cq) return -1;
  return (tap * t.g.out_c + o) * t.cq + c;
}

// Staged sign(W) of row (tap, c), columns [o, o + 8): Forward's B
// [taps * cp, op] and, read as its transpose, BackpropInput's B.
TAPEHOOK_HD int TcFilter(const TcGeom& t, int tap, int c, int o) {
  if (c >= t.cp || o >= t.op) return -1;
  return (tap * t.cp + c) * t.op + o;
}

// BackpropInput A [in_pix, taps * op]: staged dy * alpha of the output pixel
// that reads input pixel q through the tap at offset (dh, dw), channels
// [o, o + 8); -1 where no output pixel does (stride, borders).
TAPEHOOK_HD int TcBackpropInputA(const TcGeom& t, InPixel q, int dh, int dw,
                                 int o) {
  if (!q.valid || o >= t.op) return -1;
  int oh, ow;
  if (!OutputCoord(q.ih, dh, t.g.stride_h, t.g.out_h, &oh) ||
      !OutputCoord(q.iw, dw, t.g.stride_w, t.g.out_w, &ow)) {
    return -1;
  }
  return ((q.n * t.g.out_h + oh) * t.g.out_w + ow) * t.op + o;
}

// BackpropFilter A^T [pixels, taps * cp]: staged x (or sign(x)) that output
// pixel px reads for filter rows [m, m + 8), m = tap * cp + c.
TAPEHOOK_HD int TcBackpropFilterA(const TcGeom& t, OutPixel px, int m) {
  if (!px.valid || m >= t.g.taps * t.cp) return -1;
  const int tap = m / t.cp;
  return TcForwardA(t, px, TapDh(t.g, tap), TapDw(t.g, tap), m % t.cp);
}

// BackpropFilter B [pixels, op]: staged dy of output pixel p (valid: inside
// the split), channels [o, o + 8).
TAPEHOOK_HD int TcDy(const TcGeom& t, int p, bool valid, int o) {
  if (!valid || o >= t.op) return -1;
  return p * t.op + o;
}

// The reduction steps of the tap-major GEMMs (forward, backprop input) in
// order: k0 advances by `step` up to `depth` (padded channels), then the
// next tap, whose offset (dh, dw) follows along without a division.
struct TapWalk {
  int tap = 0, kw = 0, dh = 0, dw = 0, k0 = 0;
  TAPEHOOK_HD void Next(const Geom& g, int step, int depth) {
    k0 += step;
    if (k0 < depth) return;
    k0 = 0;
    ++tap;
    if (++kw < g.k_w) {
      dw += g.dil_w;
    } else {
      kw = 0, dw = 0;
      dh += g.dil_h;
    }
  }
};

// BackpropFilter's GEMM row m = tap * cp + c as an index of dw's rows
// (tap * in_c + c), or -1 in the channel padding.
TAPEHOOK_HD int TcFilterRow(const TcGeom& t, int m) {
  const int tap = m / t.cp, c = m % t.cp;
  return tap < t.g.taps && c < t.g.in_c ? tap * t.g.in_c + c : -1;
}

}  // namespace cuda
}  // namespace tapehook

#endif  // TAPEHOOK_CUDA_TC_TILES_H_
