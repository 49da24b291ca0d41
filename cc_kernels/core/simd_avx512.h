// AVX-512 inner loops of the fully binary forward, included by binary_conv.cc
// only.
//
// As with simd_avx2.h, the library is built without -mavx512* flags: each
// function here carries a target attribute and binary_conv.cc calls it only
// on a plan of the AVX-512 tier (plan.h; cpu::Avx512() in cpu.h says
// where that can run). The tier needs VPOPCNTDQ (a
// native popcount of 64-bit lanes), so it runs on Ice Lake and later Intel
// server/client cores and on AMD Zen 4 and later; other CPUs take the AVX2 or
// the portable path.
#ifndef TAPEHOOK_CORE_SIMD_AVX512_H_
#define TAPEHOOK_CORE_SIMD_AVX512_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "simd_avx2.h"

#if TAPEHOOK_HAVE_AVX2_PATH
#define TAPEHOOK_HAVE_AVX512_PATH 1
#define TAPEHOOK_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vpopcntdq,popcnt")))
#else
#define TAPEHOOK_HAVE_AVX512_PATH 0
#endif

namespace tapehook {
namespace simd {

#if TAPEHOOK_HAVE_AVX512_PATH

// Mask of the first n lanes (none for n <= 0, all for n >= lanes).
TAPEHOOK_AVX512 inline __mmask16 FirstLanes16(int64_t n) {
  return n >= 16  ? static_cast<__mmask16>(0xffff)
         : n <= 0 ? static_cast<__mmask16>(0)
                  : static_cast<__mmask16>((1u << n) - 1);
}
TAPEHOOK_AVX512 inline __mmask8 FirstLanes8(int64_t n) {
  return n >= 8   ? static_cast<__mmask8>(0xff)
         : n <= 0 ? static_cast<__mmask8>(0)
                  : static_cast<__mmask8>((1u << n) - 1);
}

// PackSigns512 of x - thr (thr: [c], the same for every row).
TAPEHOOK_AVX512 inline void PackSignsShifted512(const float* x, int64_t rows,
                                                int64_t c, uint64_t* out,
                                                const float* thr) {
  const __m512 zero = _mm512_setzero_ps();
  const int64_t cw = (c + 63) / 64;
  for (int64_t r = 0; r < rows; ++r, x += c, out += cw) {
    for (int64_t w = 0; w < cw; ++w) {
      uint64_t bits = 0;
      for (int q = 0; q < 4 && w * 64 + 16 * q < c; ++q) {
        const int64_t at = w * 64 + 16 * q;
        const __mmask16 k = FirstLanes16(c - at);
        const __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + at),
                                       _mm512_maskz_loadu_ps(k, thr + at));
        bits |= static_cast<uint64_t>(
                    _mm512_mask_cmp_ps_mask(k, v, zero, _CMP_NGE_UQ))
                << (16 * q);
      }
      out[w] = bits;
    }
  }
}

// Signs of `rows` runs of c values (input pixels of c channels): for each
// row r, out[r * cw + w] bit b = !(x[r * c + 64 w + b] >= 0), cw = the
// words per row, as simd::PackSigns does per row. One compare per 16 floats
// straight into a mask register; NGE_UQ is true for negatives and NaN, false
// for -0. Bits past c are 0. The loop over rows lives here so that it runs
// inlined under this target, with no call per pixel. With `thr` ([c], a
// per-channel threshold: RSign's beta) the signs are of x - thr, the
// difference rounded to float as a separate subtraction rounds it.
TAPEHOOK_AVX512 inline void PackSigns512(const float* x, int64_t rows,
                                         int64_t c, uint64_t* out,
                                         const float* thr = nullptr) {
  if (thr != nullptr) return PackSignsShifted512(x, rows, c, out, thr);
  const __m512 zero = _mm512_setzero_ps();
  const int64_t full = c / 64, cw = (c + 63) / 64;
  for (int64_t r = 0; r < rows; ++r, x += c, out += cw) {
    for (int64_t w = 0; w < full; ++w) {
      const float* p = x + w * 64;
      uint64_t bits = 0;
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __mmask16 neg =
            _mm512_cmp_ps_mask(_mm512_loadu_ps(p + 16 * q), zero, _CMP_NGE_UQ);
        bits |= static_cast<uint64_t>(neg) << (16 * q);
      }
      out[w] = bits;
    }
    if (full < cw) {
      // Last, partial word: masked loads never touch memory past the row.
      const float* p = x + full * 64;
      uint64_t bits = 0;
      for (int q = 0; q < 4 && full * 64 + 16 * q < c; ++q) {
        const __mmask16 k = FirstLanes16(c - full * 64 - 16 * q);
        const __m512 v = _mm512_maskz_loadu_ps(k, p + 16 * q);
        const __mmask16 neg = _mm512_mask_cmp_ps_mask(k, v, zero, _CMP_NGE_UQ);
        bits |= static_cast<uint64_t>(neg) << (16 * q);
      }
      out[full] = bits;
    }
  }
}

// Channels per chunk of PackWeightTap512: kPackGroups groups of 8 (one zmm of
// 64-bit words and one of double sums each), so that the loop-carried adds
// of the groups overlap.
constexpr int kPackGroups = 4;

// Signs of one tap of an HWIO filter, w = its [cin][n] floats: for c < cin
// and o < n, bit c % 64 of words[(c / 64) * ldw + o] = !(w[c * n + o] >= 0)
// (bits past cin are 0); tap_count[o] += popcount of o's words, and
// abs_sum[o] += |w[c * n + o]| for c = 0, 1, ... in order, in double: the
// same sums as simd::PackWeightSigns' loop over c. Per chunk of channels, a
// word's 64 bits and the sums stay in registers while c runs.
template <bool kAbsSum>
TAPEHOOK_AVX512 void PackWeightTap512(const float* w, int64_t cin, int64_t n,
                                      uint64_t* words, int64_t ldw,
                                      int32_t* tap_count, double* abs_sum) {
  constexpr int G = kPackGroups;
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < cin; c0 += 64) {
    const int64_t c1 = std::min(cin, c0 + 64);
    uint64_t* dst = words + (c0 / 64) * ldw;
    for (int64_t o = 0; o < n; o += 8 * G) {
      __mmask8 k[G];
      __m512i bits[G];
      __m512d sum[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        k[g] = FirstLanes8(n - o - 8 * g);
        bits[g] = _mm512_setzero_si512();
        sum[g] = kAbsSum ? _mm512_maskz_loadu_pd(k[g], abs_sum + o + 8 * g)
                         : _mm512_setzero_pd();
      }
      __m512i bit = _mm512_set1_epi64(1);
      for (int64_t c = c0; c < c1; ++c) {
        const float* row = w + c * n + o;
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const __m256 v = _mm256_maskz_loadu_ps(k[g], row + 8 * g);
          const __mmask8 neg =
              _mm256_mask_cmp_ps_mask(k[g], v, zero, _CMP_NGE_UQ);
          bits[g] = _mm512_mask_or_epi64(bits[g], neg, bits[g], bit);
          if (kAbsSum) {
            // Widened to double first (exact), as the scalar loop does. The
            // maskz_ forms here and below also keep GCC 12 from warning
            // about the undefined lanes of the unmasked intrinsics.
            sum[g] = _mm512_add_pd(
                sum[g], _mm512_abs_pd(_mm512_maskz_cvtps_pd(k[g], v)));
          }
        }
        bit = _mm512_add_epi64(bit, bit);
      }
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const int64_t og = o + 8 * g;
        _mm512_mask_storeu_epi64(dst + og, k[g], bits[g]);
        if (kAbsSum) _mm512_mask_storeu_pd(abs_sum + og, k[g], sum[g]);
        // Popcounts fit in 32 bits.
        const __m256i cnt =
            _mm512_maskz_cvtepi64_epi32(0xff, _mm512_popcnt_epi64(bits[g]));
        _mm256_mask_storeu_epi32(
            tap_count + og, k[g],
            _mm256_add_epi32(_mm256_maskz_loadu_epi32(k[g], tap_count + og),
                             cnt));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Bit convolution of one block of output pixels.
//
// Row r (an output pixel) of the bit im2col is not copied out: it is `segs`
// runs of `seg_len` words, seg[r * segs + s] pointing at run s (straight into
// the packed input for interior pixels, into a zero-padded copy at the
// border). Column o of b (the signs of W, [segs * seg_len][ldb], zero past
// n) is output channel o. The tile epilogue writes finished outputs:
//
//   y[r * ldy + o] = alpha[o] * (bias[r][o] - 2 * popcount(row r ^ column o))
//
// or, with an output transform (a batch norm folded in for inference), with
// dot = bias - 2 popcount and relu's max(dot, 0) first where `relu`:
//
//   y[r * ldy + o] = fma(alpha[o], dot, offset[o])
//
// plus addend[r * ldy + o] where an addend is given (a residual add folded
// in: the fma's float result plus the addend, as a separate add sums them),
//
// bias[r][o] being the all-match count of the valid taps plus twice what the
// zero words of padding taps added to the popcount. Spread over the tiles,
// the block also prefetches `prefetch_lines` cache lines from `prefetch` into
// L2: what the caller reads next (input floats to pack), so that memory
// works while the popcounts run.
template <typename T>
struct BitConvBlock {
  const uint64_t* const* seg;
  int64_t segs, seg_len;
  const uint64_t* b;
  int64_t ldb;
  const int32_t* const* bias;
  const T* alpha;
  T* y;
  int64_t ldy;
  int64_t n;
  const char* prefetch;
  int64_t prefetch_lines;
  const T* offset = nullptr;  // the output transform's, or none
  bool relu = false;
  const T* addend =
      nullptr;  // [rows][ldy] added last (with offset only), or none
};

// alpha * dot, or the output transform's fma(alpha, relu?(dot), offset)
// (+ row r's addend), for the lanes in k.
TAPEHOOK_AVX512 inline __m512 Finish(const BitConvBlock<float>& a, __m512 alpha,
                                     __m512 dot, int64_t r, int64_t o,
                                     __mmask16 k) {
  if (a.offset == nullptr) return _mm512_mul_ps(alpha, dot);
  if (a.relu) dot = _mm512_max_ps(dot, _mm512_setzero_ps());
  const __m512 v =
      _mm512_fmadd_ps(alpha, dot, _mm512_maskz_loadu_ps(k, a.offset + o));
  if (a.addend == nullptr) return v;
  return _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, a.addend + r * a.ldy + o));
}
TAPEHOOK_AVX512 inline __m512d Finish(const BitConvBlock<double>& a,
                                      __m512d alpha, __m512d dot, int64_t r,
                                      int64_t o, __mmask8 k) {
  if (a.offset == nullptr) return _mm512_mul_pd(alpha, dot);
  if (a.relu) dot = _mm512_max_pd(dot, _mm512_setzero_pd());
  const __m512d v =
      _mm512_fmadd_pd(alpha, dot, _mm512_maskz_loadu_pd(k, a.offset + o));
  if (a.addend == nullptr) return v;
  return _mm512_add_pd(v, _mm512_maskz_loadu_pd(k, a.addend + r * a.ldy + o));
}

// Register tile: kConvMR pixels by NQ (<= kConvNQ) zmm of 8 output channels.
// 6 x 4 accumulators, 4 columns of W and a broadcast fit the 32 zmm
// registers. Per word step and vector: vpxorq, vpopcntq, vpaddq.
constexpr int kConvMR = 6;
constexpr int kConvNQ = 4;

// Rows r0 .. r0 + mr - 1 of the block against channels j .. j + 8 NQ - 1.
// Rows past mr repeat row r0: computed, never stored.
template <int NQ, typename T>
TAPEHOOK_AVX512 inline void BitConvTile(const BitConvBlock<T>& a, int64_t r0,
                                        int mr, int64_t j) {
  __m512i acc[kConvMR][NQ];
#pragma GCC unroll 8
  for (int i = 0; i < kConvMR; ++i) {
#pragma GCC unroll 4
    for (int q = 0; q < NQ; ++q) acc[i][q] = _mm512_setzero_si512();
  }
  const int64_t ldb = a.ldb;
  for (int64_t s = 0; s < a.segs; ++s) {
    const uint64_t* x[kConvMR];
#pragma GCC unroll 8
    for (int i = 0; i < kConvMR; ++i) {
      x[i] = a.seg[(r0 + (i < mr ? i : 0)) * a.segs + s];
    }
    const uint64_t* bk = a.b + s * a.seg_len * ldb + j;
    for (int64_t k = 0; k < a.seg_len; ++k, bk += ldb) {
      __m512i wq[NQ];
#pragma GCC unroll 4
      for (int q = 0; q < NQ; ++q) wq[q] = _mm512_loadu_si512(bk + 8 * q);
#pragma GCC unroll 8
      for (int i = 0; i < kConvMR; ++i) {
        const __m512i xi = _mm512_set1_epi64(static_cast<int64_t>(x[i][k]));
#pragma GCC unroll 4
        for (int q = 0; q < NQ; ++q) {
          acc[i][q] = _mm512_add_epi64(
              acc[i][q], _mm512_popcnt_epi64(_mm512_xor_si512(xi, wq[q])));
        }
      }
    }
  }
  // Epilogue. Counts fit in 32 bits: float outputs take two accumulators'
  // low halves into 16 int32 lanes at once (one vpermt2d), double outputs 8.
  const __m512i low_halves = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16,
                                               18, 20, 22, 24, 26, 28, 30);
#pragma GCC unroll 8
  for (int i = 0; i < kConvMR; ++i) {
    if (i >= mr) break;
    const int32_t* bias = a.bias[r0 + i];
    T* out = a.y + (r0 + i) * a.ldy;
    if constexpr (std::is_same_v<T, float>) {
#pragma GCC unroll 4
      for (int q = 0; q < NQ; q += 2) {
        const int64_t o = j + 8 * q;
        if (o >= a.n) break;
        // With odd NQ the last vector pairs with itself: store 8 lanes.
        const bool pair = q + 1 < NQ;
        const __mmask16 k =
            FirstLanes16(std::min<int64_t>(a.n - o, pair ? 16 : 8));
        const __m512i cnt = _mm512_permutex2var_epi32(acc[i][q], low_halves,
                                                      acc[i][pair ? q + 1 : q]);
        const __m512i dot = _mm512_sub_epi32(
            _mm512_maskz_loadu_epi32(k, bias + o), _mm512_add_epi32(cnt, cnt));
        _mm512_mask_storeu_ps(
            out + o, k,
            Finish(a, _mm512_maskz_loadu_ps(k, a.alpha + o),
                   _mm512_maskz_cvtepi32_ps(k, dot), r0 + i, o, k));
      }
    } else {
#pragma GCC unroll 4
      for (int q = 0; q < NQ; ++q) {
        const int64_t o = j + 8 * q;
        if (o >= a.n) break;
        const __mmask8 k = FirstLanes8(a.n - o);
        const __m256i cnt = _mm512_maskz_cvtepi64_epi32(0xff, acc[i][q]);
        const __m256i dot = _mm256_sub_epi32(
            _mm256_maskz_loadu_epi32(k, bias + o), _mm256_add_epi32(cnt, cnt));
        _mm512_mask_storeu_pd(
            out + o, k,
            Finish(a, _mm512_maskz_loadu_pd(k, a.alpha + o),
                   _mm512_maskz_cvtepi32_pd(k, dot), r0 + i, o, k));
      }
    }
  }
}

// Short rows, float outputs: a 1x1 conv of up to 512 channels (one run of 1
// to 8 words) or a 3x3 conv of up to 64 (3 runs of 3 words, or 9 runs of 1
// when dilated). The channel tile's columns of W stay in registers (K x NQ
// zmm, K = segs * seg_len words) while the rows stream past, and a row costs
// K broadcasts and K * NQ xor / popcount / add. BitConvTile, made
// for long rows, spends most of its time around so few popcounts: clearing
// and reducing 24 accumulators and loading row pointers per tile. Same
// outputs, to the bit.
template <int SEGS, int SEG_LEN>
TAPEHOOK_AVX512 void BitConvShortK(const BitConvBlock<float>& a, int64_t rows) {
  constexpr int K = SEGS * SEG_LEN;
  constexpr int NQ = K <= 4 ? 4 : 2;
  const __m512i low_halves = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16,
                                               18, 20, 22, 24, 26, 28, 30);
  const int64_t tiles = (a.n + 8 * NQ - 1) / (8 * NQ);
  const int64_t lines_per_row = (a.prefetch_lines + tiles * rows - 1) /
                                std::max<int64_t>(1, tiles * rows);
  int64_t line = 0;
  for (int64_t j = 0; j < a.n; j += 8 * NQ) {
    // Columns past n load as zeros: computed, never stored.
    __m512i w[K][NQ];
#pragma GCC unroll 16
    for (int k = 0; k < K; ++k) {
#pragma GCC unroll 4
      for (int q = 0; q < NQ; ++q) {
        w[k][q] = _mm512_maskz_loadu_epi64(FirstLanes8(a.n - j - 8 * q),
                                           a.b + k * a.ldb + j + 8 * q);
      }
    }
    __mmask16 keep[NQ / 2];
    __m512 alpha[NQ / 2];
#pragma GCC unroll 2
    for (int h = 0; h < NQ / 2; ++h) {
      keep[h] = FirstLanes16(a.n - j - 16 * h);
      alpha[h] = _mm512_maskz_loadu_ps(keep[h], a.alpha + j + 16 * h);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t line_end = std::min(a.prefetch_lines, line + lines_per_row);
      for (; line < line_end; ++line) {
        _mm_prefetch(a.prefetch + 64 * line, _MM_HINT_T1);
      }
      const uint64_t* const* seg = a.seg + r * SEGS;
      __m512i acc[NQ];
#pragma GCC unroll 16
      for (int k = 0; k < K; ++k) {
        const __m512i xk = _mm512_set1_epi64(
            static_cast<int64_t>(seg[k / SEG_LEN][k % SEG_LEN]));
#pragma GCC unroll 4
        for (int q = 0; q < NQ; ++q) {
          const __m512i pop =
              _mm512_popcnt_epi64(_mm512_xor_si512(xk, w[k][q]));
          acc[q] = k == 0 ? pop : _mm512_add_epi64(acc[q], pop);
        }
      }
      const int32_t* bias = a.bias[r] + j;
      float* out = a.y + r * a.ldy + j;
#pragma GCC unroll 2
      for (int h = 0; h < NQ / 2; ++h) {
        // Counts fit in 32 bits: two accumulators' low halves, one vpermt2d.
        const __m512i cnt =
            _mm512_permutex2var_epi32(acc[2 * h], low_halves, acc[2 * h + 1]);
        const __m512i dot =
            _mm512_sub_epi32(_mm512_maskz_loadu_epi32(keep[h], bias + 16 * h),
                             _mm512_add_epi32(cnt, cnt));
        _mm512_mask_storeu_ps(
            out + 16 * h, keep[h],
            Finish(a, alpha[h], _mm512_maskz_cvtepi32_ps(keep[h], dot), r,
                   j + 16 * h, keep[h]));
      }
    }
  }
}

// BitConvShortK for the block's run layout if it is one of those above;
// false if not.
TAPEHOOK_AVX512 inline bool BitConvShort(const BitConvBlock<float>& a,
                                         int64_t rows) {
  using Kernel = void (*)(const BitConvBlock<float>&, int64_t);
  static constexpr Kernel kOneRun[] = {
      BitConvShortK<1, 1>, BitConvShortK<1, 2>, BitConvShortK<1, 3>,
      BitConvShortK<1, 4>, BitConvShortK<1, 5>, BitConvShortK<1, 6>,
      BitConvShortK<1, 7>, BitConvShortK<1, 8>};
  Kernel kernel = nullptr;
  if (a.segs == 1 && a.seg_len >= 1 && a.seg_len <= 8) {
    kernel = kOneRun[a.seg_len - 1];
  } else if (a.segs == 3 && a.seg_len == 3) {
    kernel = BitConvShortK<3, 3>;
  } else if (a.segs == 9 && a.seg_len == 1) {
    kernel = BitConvShortK<9, 1>;  // dilated
  }
  if (kernel == nullptr) return false;
  kernel(a, rows);
  return true;
}

// All `rows` rows of the block against channels [0, n). Channel tiles are the
// outer loop so a tile's columns of W stay in L1 across the pixels.
template <typename T>
TAPEHOOK_AVX512 void BitConv(const BitConvBlock<T>& a, int64_t rows) {
  if constexpr (std::is_same_v<T, float>) {
    if (BitConvShort(a, rows)) return;
  }
  const int64_t n8 = (a.n + 7) / 8 * 8;
  const int64_t tiles =
      (n8 + 8 * kConvNQ - 1) / (8 * kConvNQ) * ((rows + kConvMR - 1) / kConvMR);
  const int64_t lines_per_tile = (a.prefetch_lines + tiles - 1) / tiles;
  int64_t line = 0;
  for (int64_t j = 0; j < n8; j += 8 * kConvNQ) {
    const int64_t vecs = std::min<int64_t>(kConvNQ, (n8 - j) / 8);
    for (int64_t r = 0; r < rows; r += kConvMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kConvMR, rows - r));
      const int64_t line_end =
          std::min(a.prefetch_lines, line + lines_per_tile);
      for (; line < line_end; ++line) {
        _mm_prefetch(a.prefetch + 64 * line, _MM_HINT_T1);
      }
      switch (vecs) {
        case 4:
          BitConvTile<4>(a, r, mr, j);
          break;
        case 3:
          BitConvTile<3>(a, r, mr, j);
          break;
        case 2:
          BitConvTile<2>(a, r, mr, j);
          break;
        default:
          BitConvTile<1>(a, r, mr, j);
          break;
      }
    }
  }
}

#endif  // TAPEHOOK_HAVE_AVX512_PATH

}  // namespace simd
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_SIMD_AVX512_H_
