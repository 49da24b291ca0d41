// Per-element index, padding and epilogue logic of the CUDA binary Conv2D
// kernels, as __host__ __device__ inline functions: the kernels in
// binary_conv.cu call them from their tile loaders and epilogues, and
// harness/tile_logic_test.cu calls the very same functions on the host and
// compares what they compute with the CPU core.
//
// Coordinates and offsets are 32-bit (64-bit division is slow on a GPU); the
// launchers reject tensors of 2^31 or more elements.
#ifndef TAPEHOOK_CUDA_CONV_TILES_H_
#define TAPEHOOK_CUDA_CONV_TILES_H_

#include <cuda_fp16.h>

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "core/binary_conv.h"

#define TAPEHOOK_HD __host__ __device__ __forceinline__

namespace tapehook {
namespace cuda {

// ConvShape in 32-bit, plus the GEMM sizes every kernel uses.
struct Geom {
  int batch, in_h, in_w, in_c, k_h, k_w, out_c, out_h, out_w;
  int stride_h, stride_w, dil_h, dil_w, pad_top, pad_left;
  int taps;      // k_h * k_w
  int filter_k;  // taps * in_c: rows of the HWIO filter as a matrix
  int out_pix;   // batch * out_h * out_w
  int in_pix;    // batch * in_h * in_w
  int words;     // 32-bit words per packed input pixel: ceil(in_c / 32)
};

inline Geom MakeGeom(const ConvShape& s) {
  Geom g;
  g.batch = int(s.batch), g.in_h = int(s.in_h), g.in_w = int(s.in_w);
  g.in_c = int(s.in_c), g.k_h = int(s.k_h), g.k_w = int(s.k_w);
  g.out_c = int(s.out_c), g.out_h = int(s.out_h), g.out_w = int(s.out_w);
  g.stride_h = int(s.stride_h), g.stride_w = int(s.stride_w);
  g.dil_h = int(s.dil_h), g.dil_w = int(s.dil_w);
  g.pad_top = int(s.pad_top), g.pad_left = int(s.pad_left);
  g.taps = g.k_h * g.k_w;
  g.filter_k = g.taps * g.in_c;
  g.out_pix = g.batch * g.out_h * g.out_w;
  g.in_pix = g.batch * g.in_h * g.in_w;
  g.words = (g.in_c + 31) / 32;
  return g;
}

TAPEHOOK_HD float ToFloat(float v) { return v; }
TAPEHOOK_HD float ToFloat(__half v) { return __half2float(v); }
template <typename T>
TAPEHOOK_HD T FromFloat(float v);
template <>
TAPEHOOK_HD float FromFloat<float>(float v) {
  return v;
}
template <>
TAPEHOOK_HD __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// sign(t) = +1 if t >= 0 else -1, NaN included, exactly as the core.
TAPEHOOK_HD float SignOf(float t) { return t >= 0.0f ? 1.0f : -1.0f; }
// Packed bit of sign(t): 1 for -1, so xor counts the sign mismatches.
TAPEHOOK_HD uint32_t NegativeBit(float t) { return t >= 0.0f ? 0u : 1u; }

TAPEHOOK_HD int Popcount(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

// e'(t) in float; the core's EstimatorGrad in double.
TAPEHOOK_HD float EstimatorGradF(Estimator e, float t, float clip) {
  switch (e) {
    case Estimator::kNone:
      return 1.0f;
    case Estimator::kSteSign:
      return fabsf(t) <= clip ? 1.0f : 0.0f;
    case Estimator::kApproxSign:
      return fabsf(t) <= 1.0f ? 2.0f - 2.0f * fabsf(t) : 0.0f;
    case Estimator::kSwishSign: {
      const float bt = 5.0f * t;
      const float ch = coshf(bt);
      // cosh overflows float long before the true value stops underflowing.
      if (!(ch <= FLT_MAX)) return 0.0f;
      return 5.0f * (2.0f - bt * tanhf(0.5f * bt)) / (1.0f + ch);
    }
  }
  return 1.0f;
}

// ---------------------------------------------------------------------------
// Output pixel p as a GEMM row: where its receptive field starts.

struct OutPixel {
  int n, ih0, iw0;  // ih0 = oh * stride_h - pad_top (may be negative)
  bool valid;       // p < out_pix (tiles overhang the last pixels)
};

TAPEHOOK_HD OutPixel OutPixelAt(const Geom& g, int p) {
  if (p >= g.out_pix) return {0, 0, 0, false};
  const int ow = p % g.out_w;
  const int t = p / g.out_w;
  return {t / g.out_h, (t % g.out_h) * g.stride_h - g.pad_top,
          ow * g.stride_w - g.pad_left, true};
}

// Filter row k = (kh * k_w + kw) * in_c + c as a GEMM index.
struct FilterRow {
  int dh, dw;  // kh * dil_h, kw * dil_w
  int c;
  bool valid;  // k < filter_k
};

TAPEHOOK_HD FilterRow FilterRowAt(const Geom& g, int k) {
  if (k >= g.filter_k) return {0, 0, 0, false};
  const int tap = k / g.in_c;
  return {(tap / g.k_w) * g.dil_h, (tap % g.k_w) * g.dil_w, k % g.in_c, true};
}

// Input pixel (n, ih, iw) read by an output pixel through one tap, or -1 in
// the zero padding.
TAPEHOOK_HD int InputPixelIndex(const Geom& g, OutPixel px, int dh, int dw) {
  const int ih = px.ih0 + dh, iw = px.iw0 + dw;
  if (ih < 0 || ih >= g.in_h || iw < 0 || iw >= g.in_w) return -1;
  return (px.n * g.in_h + ih) * g.in_w + iw;
}

// im2col[p, k]: x_hat of the input element output pixel p reads through
// filter row k; 0 (not sign(0)) in the padding and outside the matrix.
template <typename T>
TAPEHOOK_HD float Im2ColValue(const Geom& g, const T* x, bool binary,
                              OutPixel px, FilterRow f) {
  if (!px.valid || !f.valid) return 0.0f;
  const int pix = InputPixelIndex(g, px, f.dh, f.dw);
  if (pix < 0) return 0.0f;
  const float v = ToFloat(x[pix * g.in_c + f.c]);
  return binary ? SignOf(v) : v;
}

// sign(W)[k, o] of the HWIO filter as a [filter_k, out_c] matrix; alpha is
// applied in the epilogue. 0 outside the matrix.
template <typename T>
TAPEHOOK_HD float SignWeight(const Geom& g, const T* w, int k, int o) {
  if (k >= g.filter_k || o >= g.out_c) return 0.0f;
  return SignOf(ToFloat(w[k * g.out_c + o]));
}

// Number of filter taps of output pixel px that land inside the input.
TAPEHOOK_HD int ValidTaps(const Geom& g, OutPixel px) {
  int rows = 0, cols = 0;
  for (int kh = 0; kh < g.k_h; ++kh) {
    const int ih = px.ih0 + kh * g.dil_h;
    rows += ih >= 0 && ih < g.in_h;
  }
  for (int kw = 0; kw < g.k_w; ++kw) {
    const int iw = px.iw0 + kw * g.dil_w;
    cols += iw >= 0 && iw < g.in_w;
  }
  return rows * cols;
}

// ---------------------------------------------------------------------------
// Fully binary forward: xor + popcount over packed sign bits.
//
// Packed input: xbits[in_pixel * words + j], bit b = sign bit of channel
// 32 j + b (bits past in_c are 0). Packed filter: wbits[kw * out_c + o] for
// packed row kw = tap * words + j, same bit order, and wpop[tap * out_c + o]
// = popcount of that tap's words. A padded tap is loaded as a 0 word, which
// adds popcount(w) instead of nothing; BinaryDotEpilogue takes it back out.

// Word j of the packed signs of channels [32 j, 32 j + 32) of one row.
template <typename T>
TAPEHOOK_HD uint32_t PackSignWord(const T* row, int stride, int j, int count) {
  uint32_t word = 0;
  for (int b = 0; b < 32 && 32 * j + b < count; ++b) {
    word |= NegativeBit(ToFloat(row[(32 * j + b) * stride])) << b;
  }
  return word;
}

// Packs all words of one (tap, o) of the HWIO filter; returns their popcount.
template <typename T>
TAPEHOOK_HD int PackFilterTap(const Geom& g, const T* w, int tap, int o,
                              uint32_t* wbits) {
  int pop = 0;
  for (int j = 0; j < g.words; ++j) {
    const uint32_t word =
        PackSignWord(w + tap * g.in_c * g.out_c + o, g.out_c, j, g.in_c);
    wbits[(tap * g.words + j) * g.out_c + o] = word;
    pop += Popcount(word);
  }
  return pop;
}

// Packed row kw = tap * words + j of a packed-filter GEMM column.
struct PackedRow {
  int dh, dw, j;
  bool valid;
};

TAPEHOOK_HD PackedRow PackedRowAt(const Geom& g, int kw) {
  if (kw >= g.taps * g.words) return {0, 0, 0, false};
  const int tap = kw / g.words;
  return {(tap / g.k_w) * g.dil_h, (tap % g.k_w) * g.dil_w, kw % g.words, true};
}

// Packed im2col word: 0 in the padding and outside the matrix.
TAPEHOOK_HD uint32_t PackedIm2ColWord(const Geom& g, const uint32_t* xbits,
                                      OutPixel px, PackedRow r) {
  if (!px.valid || !r.valid) return 0u;
  const int pix = InputPixelIndex(g, px, r.dh, r.dw);
  return pix < 0 ? 0u : xbits[pix * g.words + r.j];
}

TAPEHOOK_HD uint32_t PackedWeightWord(const Geom& g, const uint32_t* wbits,
                                      int kw, int o) {
  if (kw >= g.taps * g.words || o >= g.out_c) return 0u;
  return wbits[kw * g.out_c + o];
}

// y[p, o] from mismatches = sum over all taps (padding as 0 words) of
// popcount(x ^ w): each valid tap contributes in_c - 2 * its mismatches.
TAPEHOOK_HD float BinaryDotEpilogue(const Geom& g, const int* wpop, OutPixel px,
                                    int o, int mismatches) {
  const int valid = ValidTaps(g, px);
  if (valid < g.taps) {
    for (int tap = 0; tap < g.taps; ++tap) {
      const int dh = (tap / g.k_w) * g.dil_h, dw = (tap % g.k_w) * g.dil_w;
      if (InputPixelIndex(g, px, dh, dw) < 0) {
        mismatches -= wpop[tap * g.out_c + o];
      }
    }
  }
  return float(valid * g.in_c - 2 * mismatches);
}

// ---------------------------------------------------------------------------
// BackpropInput as a gather GEMM: dx[q, c] = sum over (tap, o) of
// dy[pixel that reads q through tap, o] * W_hat[tap, c, o], then * e'(x).

// Input pixel q as a GEMM row.
struct InPixel {
  int n, ih, iw;  // ih + pad_top, iw + pad_left
  bool valid;
};

TAPEHOOK_HD InPixel InPixelAt(const Geom& g, int q) {
  if (q >= g.in_pix) return {0, 0, 0, false};
  const int iw = q % g.in_w;
  const int t = q / g.in_w;
  return {t / g.in_h, t % g.in_h + g.pad_top, iw + g.pad_left, true};
}

// Reduction index k = tap * out_c + o (o fastest: dy loads coalesce).
struct DyColumn {
  int dh, dw, tap, o;
  bool valid;
};

TAPEHOOK_HD DyColumn DyColumnAt(const Geom& g, int k) {
  if (k >= g.taps * g.out_c) return {0, 0, 0, 0, false};
  const int tap = k / g.out_c;
  return {(tap / g.k_w) * g.dil_h, (tap % g.k_w) * g.dil_w, tap, k % g.out_c,
          true};
}

// The output coordinate whose tap at offset d reads padded input coordinate
// i: out * stride + d == i; false if there is none.
TAPEHOOK_HD bool OutputCoord(int i, int d, int stride, int out_size, int* out) {
  const int t = i - d;
  if (t < 0) return false;
  if (stride == 1) {  // the common case, without an integer division
    *out = t;
  } else {
    if (t % stride != 0) return false;
    *out = t / stride;
  }
  return *out < out_size;
}

template <typename T>
TAPEHOOK_HD float DyGatherValue(const Geom& g, const T* dy, InPixel q,
                                DyColumn k) {
  if (!q.valid || !k.valid) return 0.0f;
  int oh, ow;
  if (!OutputCoord(q.ih, k.dh, g.stride_h, g.out_h, &oh) ||
      !OutputCoord(q.iw, k.dw, g.stride_w, g.out_w, &ow)) {
    return 0.0f;
  }
  return ToFloat(dy[((q.n * g.out_h + oh) * g.out_w + ow) * g.out_c + k.o]);
}

// W_hat[tap, c, o] = alpha[o] * sign(W) for reduction index k and column c.
template <typename T>
TAPEHOOK_HD float ScaledSignWeightT(const Geom& g, const T* w,
                                    const float* alpha, DyColumn k, int c) {
  if (!k.valid || c >= g.in_c) return 0.0f;
  return alpha[k.o] * SignOf(ToFloat(w[(k.tap * g.in_c + c) * g.out_c + k.o]));
}

// dx[idx] from its GEMM sum: times e'(x[idx]) for a binarized input; x is
// not read for a float one (kNone), where it may be null.
template <typename T>
TAPEHOOK_HD float BackpropInputEpilogue(const T* x, int idx, Estimator act_est,
                                        float clip, float sum) {
  return act_est == Estimator::kNone
             ? sum
             : sum * EstimatorGradF(act_est, ToFloat(x[idx]), clip);
}

// ---------------------------------------------------------------------------
// BackpropFilter: dw[k, o] = sum_p im2col[p, k] * dy[p, o] (split over
// pixel ranges, partial sums reduced in order), then * alpha[o] * e'(W).

template <typename T>
TAPEHOOK_HD float DyValue(const Geom& g, const T* dy, int p, int o) {
  if (p >= g.out_pix || o >= g.out_c) return 0.0f;
  return ToFloat(dy[p * g.out_c + o]);
}

// Pixel range of split z of `splits`, each a multiple of `align` long.
TAPEHOOK_HD void SplitRange(int total, int splits, int align, int z, int* begin,
                            int* end) {
  const int per = ((total + splits - 1) / splits + align - 1) / align * align;
  *begin = z * per < total ? z * per : total;
  *end = *begin + per < total ? *begin + per : total;
}

// ---------------------------------------------------------------------------
// alpha[o] = mean |W[:, o]| (kMeanAbs) or 1: the sum over rows
// [k0, filter_k) step `step`, so threads can split the rows.

template <typename T>
TAPEHOOK_HD float AbsColumnSum(const Geom& g, const T* w, int o, int k0,
                               int step) {
  float sum = 0.0f;
  for (int k = k0; k < g.filter_k; k += step) {
    sum += fabsf(ToFloat(w[k * g.out_c + o]));
  }
  return sum;
}

}  // namespace cuda
}  // namespace tapehook

#endif  // TAPEHOOK_CUDA_CONV_TILES_H_
