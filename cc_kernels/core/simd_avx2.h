// AVX2 inner loops of the core, included by binary_conv.cc only.
//
// The library is built without -mavx2, so it loads on any x86-64 (and other)
// CPU: each function here carries a target attribute and binary_conv.cc calls
// it only on a plan of the AVX2 tier (plan.h), which Capabilities() offers
// only where cpu::Avx2() (cpu.h) says the CPU has it.
#ifndef TAPEHOOK_CORE_SIMD_AVX2_H_
#define TAPEHOOK_CORE_SIMD_AVX2_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TAPEHOOK_HAVE_AVX2_PATH 1
#include <immintrin.h>
#define TAPEHOOK_AVX2 __attribute__((target("avx2,fma,popcnt")))
#else
#define TAPEHOOK_HAVE_AVX2_PATH 0
#endif

namespace tapehook {
namespace simd {

#if TAPEHOOK_HAVE_AVX2_PATH

// Register tile of the float GEMM: kMR rows of C by two 256-bit vectors.
constexpr int kGemmMR = 6;
template <typename T>
constexpr int GemmNR() {
  return 2 * 32 / static_cast<int>(sizeof(T));
}

TAPEHOOK_AVX2 inline __m256 Load(const float* p) { return _mm256_loadu_ps(p); }
TAPEHOOK_AVX2 inline __m256d Load(const double* p) {
  return _mm256_loadu_pd(p);
}
TAPEHOOK_AVX2 inline void Store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
TAPEHOOK_AVX2 inline void Store(double* p, __m256d v) {
  _mm256_storeu_pd(p, v);
}
TAPEHOOK_AVX2 inline __m256 Broadcast(const float* p) {
  return _mm256_broadcast_ss(p);
}
TAPEHOOK_AVX2 inline __m256d Broadcast(const double* p) {
  return _mm256_broadcast_sd(p);
}
TAPEHOOK_AVX2 inline __m256 Fma(__m256 a, __m256 b, __m256 c) {
  return _mm256_fmadd_ps(a, b, c);
}
TAPEHOOK_AVX2 inline __m256d Fma(__m256d a, __m256d b, __m256d c) {
  return _mm256_fmadd_pd(a, b, c);
}
TAPEHOOK_AVX2 inline __m256 Zero(const float*) { return _mm256_setzero_ps(); }
TAPEHOOK_AVX2 inline __m256d Zero(const double*) { return _mm256_setzero_pd(); }

// One full-width tile: c[i, 0:NR] (+)= sum_k a[k][i] * b[k, 0:NR] for
// i < kGemmMR, a being a packed [depth][kGemmMR] panel. 12 accumulators stay
// in registers; rows >= mr are zero padding, computed but not stored.
template <typename T>
TAPEHOOK_AVX2 void GemmTile(int64_t depth, const T* a, const T* b, int64_t ldb,
                            T* c, int64_t ldc, bool accumulate, int mr) {
  constexpr int L = 32 / sizeof(T);  // lanes per vector
  using V = decltype(Load(static_cast<const T*>(nullptr)));
  // Ragged tiles (mr < kGemmMR) go through a full-size scratch tile: with
  // only constant trip counts touching acc, it stays in registers.
  T scratch[kGemmMR * 2 * L];
  T* ct = c;
  int64_t ldt = ldc;
  if (mr < kGemmMR) {
    for (int i = 0; i < kGemmMR * 2 * L; ++i) scratch[i] = T(0);
    for (int i = 0; i < mr && accumulate; ++i) {
      for (int j = 0; j < 2 * L; ++j) scratch[i * 2 * L + j] = c[i * ldc + j];
    }
    ct = scratch;
    ldt = 2 * L;
  }
  // Twelve named accumulators: GCC keeps an array of 12 vectors in memory.
#define TAPEHOOK_ROW(i)                                     \
  V acc##i##0 = accumulate ? Load(ct + i * ldt) : Zero(ct); \
  V acc##i##1 = accumulate ? Load(ct + i * ldt + L) : Zero(ct);
  TAPEHOOK_ROW(0)
  TAPEHOOK_ROW(1)
  TAPEHOOK_ROW(2)
  TAPEHOOK_ROW(3)
  TAPEHOOK_ROW(4)
  TAPEHOOK_ROW(5)
#undef TAPEHOOK_ROW
  for (int64_t k = 0; k < depth; ++k) {
    // B panels stream from L2; the hardware prefetcher alone stalls here.
    _mm_prefetch(reinterpret_cast<const char*>(b + (k + 8) * ldb), _MM_HINT_T0);
    const V b0 = Load(b + k * ldb), b1 = Load(b + k * ldb + L);
    const T* ak = a + k * kGemmMR;
#define TAPEHOOK_ROW(i)                 \
  {                                     \
    const V ai = Broadcast(ak + i);     \
    acc##i##0 = Fma(ai, b0, acc##i##0); \
    acc##i##1 = Fma(ai, b1, acc##i##1); \
  }
    TAPEHOOK_ROW(0)
    TAPEHOOK_ROW(1)
    TAPEHOOK_ROW(2)
    TAPEHOOK_ROW(3)
    TAPEHOOK_ROW(4)
    TAPEHOOK_ROW(5)
#undef TAPEHOOK_ROW
  }
#define TAPEHOOK_ROW(i)           \
  Store(ct + i * ldt, acc##i##0); \
  Store(ct + i * ldt + L, acc##i##1);
  TAPEHOOK_ROW(0)
  TAPEHOOK_ROW(1)
  TAPEHOOK_ROW(2)
  TAPEHOOK_ROW(3)
  TAPEHOOK_ROW(4)
  TAPEHOOK_ROW(5)
#undef TAPEHOOK_ROW
  for (int i = 0; i < mr && ct == scratch; ++i) {
    for (int j = 0; j < 2 * L; ++j) c[i * ldc + j] = scratch[i * 2 * L + j];
  }
}

// Per-byte popcount of v by 4-bit table lookup (AVX2 has no vpopcnt).
TAPEHOOK_AVX2 inline __m256i ByteCounts(__m256i v) {
  const __m256i lut =
      _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1,
                       2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i lo = _mm256_and_si256(v, low);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  return _mm256_add_epi8(_mm256_shuffle_epi8(lut, lo),
                         _mm256_shuffle_epi8(lut, hi));
}

// Tile of the xor-popcount: kPopMR rows of a by kPopNR columns of b (four
// ymm of 64-bit lanes). Its 8 byte accumulators, 2 broadcast rows, a column
// vector, temporaries and the lookup constants fit the 16 ymm registers.
constexpr int kPopMR = 2;
constexpr int kPopNR = 16;

// counts[i * ldc + j] = sum_k popcount(a[i * depth + k] ^ b[k * n + j]) for
// i < m, j < n; m must be a multiple of kPopMR and n of kPopNR. Output
// columns sit in the 64-bit lanes, so a lane's byte counts sum (vpsadbw) to
// that column's count: no horizontal sums, and depth need not be padded.
TAPEHOOK_AVX2 inline void XorPopcount(int64_t m, int64_t n, int64_t depth,
                                      const uint64_t* a, const uint64_t* b,
                                      int32_t* counts, int64_t ldc) {
  // A byte counter gains at most 8 per step: flush before 255 / 8 steps.
  constexpr int64_t kFlushSteps = 31;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t i = 0; i < m; i += kPopMR) {
    const uint64_t* a0 = a + i * depth;
    const uint64_t* a1 = a0 + depth;
    for (int64_t j = 0; j < n; j += kPopNR) {
      __m256i total[kPopMR][4];
      for (auto& row : total) {
        for (auto& v : row) v = zero;
      }
      for (int64_t k0 = 0; k0 < depth; k0 += kFlushSteps) {
        const int64_t k1 = std::min(depth, k0 + kFlushSteps);
        __m256i c00 = zero, c01 = zero, c02 = zero, c03 = zero;
        __m256i c10 = zero, c11 = zero, c12 = zero, c13 = zero;
        for (int64_t k = k0; k < k1; ++k) {
          const __m256i x0 = _mm256_set1_epi64x(static_cast<int64_t>(a0[k]));
          const __m256i x1 = _mm256_set1_epi64x(static_cast<int64_t>(a1[k]));
          const __m256i* bk = reinterpret_cast<const __m256i*>(b + k * n + j);
#define TAPEHOOK_STEP(q)                                                  \
  {                                                                       \
    const __m256i wq = _mm256_loadu_si256(bk + q);                        \
    c0##q = _mm256_add_epi8(c0##q, ByteCounts(_mm256_xor_si256(x0, wq))); \
    c1##q = _mm256_add_epi8(c1##q, ByteCounts(_mm256_xor_si256(x1, wq))); \
  }
          TAPEHOOK_STEP(0)
          TAPEHOOK_STEP(1)
          TAPEHOOK_STEP(2)
          TAPEHOOK_STEP(3)
#undef TAPEHOOK_STEP
        }
        const __m256i c[kPopMR][4] = {{c00, c01, c02, c03},
                                      {c10, c11, c12, c13}};
        for (int r = 0; r < kPopMR; ++r) {
          for (int q = 0; q < 4; ++q) {
            total[r][q] =
                _mm256_add_epi64(total[r][q], _mm256_sad_epu8(c[r][q], zero));
          }
        }
      }
      // Counts fit in 32 bits: keep the low half of each 64-bit lane.
      const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
      for (int r = 0; r < kPopMR; ++r) {
        for (int q = 0; q < 4; ++q) {
          _mm_storeu_si128(
              reinterpret_cast<__m128i*>(counts + (i + r) * ldc + j + 4 * q),
              _mm256_castsi256_si128(
                  _mm256_permutevar8x32_epi32(total[r][q], low_halves)));
        }
      }
    }
  }
}

// One output pixel of the bitpacked forward from its mismatch counts:
// out[o] = alpha[o] * dot, dot = all_match - 2 * counts[o], or with an
// offset (the output transform) fma(alpha[o], relu ? max(dot, 0) : dot,
// offset[o]) in one rounding, as std::fma. Generic x86-64 code has no FMA
// instruction: there std::fma is a call to libm per element. The last
// n % 8 channels go through masked loads and stores (no scalar twin).
TAPEHOOK_AVX2 inline void CountsToOutputs(const int32_t* counts,
                                          int32_t all_match, const float* alpha,
                                          const float* offset, bool relu,
                                          int64_t n, float* out) {
  const __m256i match = _mm256_set1_epi32(all_match);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t o = 0; o < n; o += 8) {
    const int32_t left = static_cast<int32_t>(std::min<int64_t>(8, n - o));
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lanes);
    const __m256i cnt = _mm256_maskload_epi32(counts + o, mask);
    __m256i dot = _mm256_sub_epi32(match, _mm256_add_epi32(cnt, cnt));
    const __m256 a = _mm256_maskload_ps(alpha + o, mask);
    if (relu && offset != nullptr) dot = _mm256_max_epi32(dot, zero);
    const __m256 d = _mm256_cvtepi32_ps(dot);
    _mm256_maskstore_ps(
        out + o, mask,
        offset == nullptr
            ? _mm256_mul_ps(a, d)
            : _mm256_fmadd_ps(a, d, _mm256_maskload_ps(offset + o, mask)));
  }
}

// out[w] bit b = !(x[64 w + b] >= 0) for b < 64, c = count of values
// (sign(t) = -1 maps to bit 1; NaN too, as in Sign()). Bits past c are 0.
TAPEHOOK_AVX2 inline void PackSigns(const float* x, int64_t c, uint64_t* out) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t w = 0; w * 64 < c; ++w) {
    uint64_t bits = 0;
    int64_t k = 0;
    for (; k + 8 <= 64 && w * 64 + k + 8 <= c; k += 8) {
      const __m256 v = _mm256_loadu_ps(x + w * 64 + k);
      const int m = _mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NGE_UQ));
      bits |= static_cast<uint64_t>(m) << k;
    }
    for (; k < 64 && w * 64 + k < c; ++k) {
      bits |= static_cast<uint64_t>(!(x[w * 64 + k] >= 0.0f)) << k;
    }
    out[w] = bits;
  }
}

// For o < n: words[o] |= !(w[o] >= 0) << shift, abs_sum[o] += |w[o]|
// (abs_sum may be null). One input channel of one tap of an HWIO filter.
TAPEHOOK_AVX2 inline void PackWeightSigns(const float* w, int64_t n, int shift,
                                          uint64_t* words, double* abs_sum) {
  const __m128 zero = _mm_setzero_ps();
  const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(1) << shift);
  int64_t o = 0;
  for (; o + 4 <= n; o += 4) {
    const __m128 v = _mm_loadu_ps(w + o);
    const __m256i negative = _mm256_cvtepi32_epi64(
        _mm_castps_si128(_mm_cmp_ps(v, zero, _CMP_NGE_UQ)));
    __m256i* dst = reinterpret_cast<__m256i*>(words + o);
    _mm256_storeu_si256(dst, _mm256_or_si256(_mm256_loadu_si256(dst),
                                             _mm256_and_si256(negative, bit)));
    if (abs_sum != nullptr) {
      const __m256d a = _mm256_cvtps_pd(_mm_and_ps(v, abs_mask));
      _mm256_storeu_pd(abs_sum + o,
                       _mm256_add_pd(_mm256_loadu_pd(abs_sum + o), a));
    }
  }
  for (; o < n; ++o) {
    words[o] |= static_cast<uint64_t>(!(w[o] >= 0.0f)) << shift;
    if (abs_sum != nullptr) abs_sum[o] += std::abs(static_cast<double>(w[o]));
  }
}

#endif  // TAPEHOOK_HAVE_AVX2_PATH

}  // namespace simd
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_SIMD_AVX2_H_
