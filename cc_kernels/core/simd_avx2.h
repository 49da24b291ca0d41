// AVX2 inner loops of the core, included by the .cc files that call them.
//
// The library is built without -mavx2, so it loads on any x86-64 (and other)
// CPU: each function here carries a target attribute and the core calls it
// only on a plan of the AVX2 tier or above (plan.h), which Capabilities()
// offers only where cpu::Avx2() (cpu.h) says the CPU has it.
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

// The A of one GEMM register tile, MR rows: element (i, k) at At(i, k).
// Either a packed [depth][MR] panel ...
template <typename T, int MR>
struct PanelA {
  const T* a;
  const T* At(int i, int64_t k) const { return a + k * MR + i; }
};
// ... or MR contiguous runs read in place (rows gathered by pointer).
template <typename T, int MR>
struct RowsA {
  const T* rows[MR];
  const T* At(int i, int64_t k) const { return rows[i] + k; }
};

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

// One full-width tile: c[i, 0:NR] (+)= sum_k A(i, k) * b[k, 0:NR] for
// i < kGemmMR, A a PanelA or RowsA. 12 accumulators stay in registers;
// rows >= mr are zero padding, computed but not stored.
template <typename T, typename A>
TAPEHOOK_AVX2 void GemmTileWith(int64_t depth, const A& a, const T* b,
                                int64_t ldb, T* c, int64_t ldc, bool accumulate,
                                int mr) {
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
#define TAPEHOOK_ROW(i)                 \
  {                                     \
    const V ai = Broadcast(a.At(i, k)); \
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

// Nibble form of a word of signs (AVX2 has no vpopcnt, so popcounts go
// through a 16-entry byte table): the low nibble of each byte, then the high
// one, as two words whose bytes hold 0..15. Shifts and masks commute with
// xor, so the xor of two nibble forms is the nibble form of the xor: split
// once when x and W are packed, the inner loop does only xor, lookup, add.
// (bitpacked.h's LowNibbles / HighNibbles make it.)

// Columns of a nibble panel: the xor-popcount's register tile is one row of
// a by kPopNR columns of b (four ymm of 64-bit lanes).
constexpr int kPopNR = 16;

// counts[i * ldc + j] = sum_k popcount(a[i][k] ^ b[k][j]) for i < m, j < n
// (n a multiple of kPopNR), from nibble forms: a as [m][depth][lo, hi] and
// b as panels [n / kPopNR][depth][lo | hi][kPopNR]. Output columns sit in
// the 64-bit lanes, so a lane's byte counts sum (vpsadbw) to its column's
// count: no horizontal sums. Per 4 words: 2 xor, 2 vpshufb, 2 adds (not 8
// ops with the nibbles split in the loop), and the panel, depth * 256 bytes,
// stays in L1 across the m rows.
TAPEHOOK_AVX2 inline void XorPopcountNibbles(int64_t m, int64_t n,
                                             int64_t depth, const uint64_t* a,
                                             const uint64_t* b, int32_t* counts,
                                             int64_t ldc) {
  // A byte counter gains at most 4 + 4 per step: flush before 255 / 8 steps.
  constexpr int64_t kFlushSteps = 31;
  const __m256i zero = _mm256_setzero_si256();
  const __m256i lut =
      _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1,
                       2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4);
  // Counts fit in 32 bits: keep the low half of each 64-bit lane.
  const __m256i low_halves = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  for (int64_t j = 0; j < n; j += kPopNR) {
    const uint64_t* panel = b + j * depth * 2;
    for (int64_t i = 0; i < m; ++i) {
      const uint64_t* ai = a + i * depth * 2;
      __m256i t0 = zero, t1 = zero, t2 = zero, t3 = zero;
      for (int64_t k0 = 0; k0 < depth; k0 += kFlushSteps) {
        const int64_t k1 = std::min(depth, k0 + kFlushSteps);
        __m256i c0 = zero, c1 = zero, c2 = zero, c3 = zero;
        for (int64_t k = k0; k < k1; ++k) {
          const __m256i lo =
              _mm256_set1_epi64x(static_cast<int64_t>(ai[2 * k]));
          const __m256i hi =
              _mm256_set1_epi64x(static_cast<int64_t>(ai[2 * k + 1]));
          const __m256i* bk =
              reinterpret_cast<const __m256i*>(panel + k * 2 * kPopNR);
#define TAPEHOOK_STEP(q)                                           \
  {                                                                \
    const __m256i wl = _mm256_loadu_si256(bk + q);                 \
    const __m256i wh = _mm256_loadu_si256(bk + 4 + q);             \
    c##q = _mm256_add_epi8(                                        \
        c##q, _mm256_shuffle_epi8(lut, _mm256_xor_si256(lo, wl))); \
    c##q = _mm256_add_epi8(                                        \
        c##q, _mm256_shuffle_epi8(lut, _mm256_xor_si256(hi, wh))); \
  }
          TAPEHOOK_STEP(0)
          TAPEHOOK_STEP(1)
          TAPEHOOK_STEP(2)
          TAPEHOOK_STEP(3)
#undef TAPEHOOK_STEP
        }
        t0 = _mm256_add_epi64(t0, _mm256_sad_epu8(c0, zero));
        t1 = _mm256_add_epi64(t1, _mm256_sad_epu8(c1, zero));
        t2 = _mm256_add_epi64(t2, _mm256_sad_epu8(c2, zero));
        t3 = _mm256_add_epi64(t3, _mm256_sad_epu8(c3, zero));
      }
      const __m256i t[4] = {t0, t1, t2, t3};
      for (int q = 0; q < 4; ++q) {
        _mm_storeu_si128(
            reinterpret_cast<__m128i*>(counts + i * ldc + j + 4 * q),
            _mm256_castsi256_si128(
                _mm256_permutevar8x32_epi32(t[q], low_halves)));
      }
    }
  }
}

// Lanes [0, left) of a vmaskmov mask, for the last n % 8 elements of a row.
TAPEHOOK_AVX2 inline __m256i TailMask(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One output pixel of the bitpacked forward from its mismatch counts:
// out[o] = alpha[o] * dot, dot = all_match - 2 * counts[o], or with an
// offset (the output transform) fma(alpha[o], relu ? max(dot, 0) : dot,
// offset[o]) in one rounding, as std::fma. Generic x86-64 code has no FMA
// instruction: there std::fma is a call to libm per element. Whole vectors
// load and store plainly; only the last n % 8 channels take vmaskmov, which
// AMD cores run microcoded (a masked store every 8 channels cost a quarter
// of the popcounts' time on Zen 3). One arithmetic for both.
TAPEHOOK_AVX2 inline __m256 OutputsOf(__m256i cnt, __m256i match, __m256 a,
                                      const __m256* offset, bool relu) {
  __m256i dot = _mm256_sub_epi32(match, _mm256_add_epi32(cnt, cnt));
  if (offset == nullptr) return _mm256_mul_ps(a, _mm256_cvtepi32_ps(dot));
  if (relu) dot = _mm256_max_epi32(dot, _mm256_setzero_si256());
  return _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(dot), *offset);
}

// addend (with offset only; may be out): added to the transform's float
// result, as a separate add would.
TAPEHOOK_AVX2 inline void CountsToOutputs(const int32_t* counts,
                                          int32_t all_match, const float* alpha,
                                          const float* offset, bool relu,
                                          const float* addend, int64_t n,
                                          float* out) {
  const __m256i match = _mm256_set1_epi32(all_match);
  int64_t o = 0;
  for (; o + 8 <= n; o += 8) {
    const __m256i cnt =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(counts + o));
    __m256 off;
    if (offset != nullptr) off = _mm256_loadu_ps(offset + o);
    __m256 v = OutputsOf(cnt, match, _mm256_loadu_ps(alpha + o),
                         offset != nullptr ? &off : nullptr, relu);
    if (addend != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(addend + o));
    _mm256_storeu_ps(out + o, v);
  }
  if (o == n) return;
  const __m256i mask = TailMask(n - o);
  __m256 off;
  if (offset != nullptr) off = _mm256_maskload_ps(offset + o, mask);
  __m256 v = OutputsOf(_mm256_maskload_epi32(counts + o, mask), match,
                       _mm256_maskload_ps(alpha + o, mask),
                       offset != nullptr ? &off : nullptr, relu);
  if (addend != nullptr) {
    v = _mm256_add_ps(v, _mm256_maskload_ps(addend + o, mask));
  }
  _mm256_maskstore_ps(out + o, mask, v);
}

// 1.0f or 0.0f per lane for channels c .. c + 7 of ScaleByMaskBits' row.
TAPEHOOK_AVX2 inline __m256 MaskFactors(const uint8_t* bits, int64_t c,
                                        int64_t n) {
  // The second byte only where the row has channels past c + 4.
  const int32_t word = bits[c / 4] | (c + 4 < n ? bits[c / 4 + 1] << 8 : 0);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bit = _mm256_and_si256(
      _mm256_srlv_epi32(_mm256_set1_epi32(word),
                        _mm256_setr_epi32(6, 4, 2, 0, 14, 12, 10, 8)),
      one);
  return _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, one)),
                       _mm256_set1_ps(1.0f));
}

// g[c] *= 1 or 0, the ste_sign mask of a packed row (pack_input.h: bit
// 6 - 2 (c % 4) of bits[c / 4]) for c < n: 8 channels from 2 bytes, one
// variable shift per lane. A multiply by 1.0f or 0.0f, as the portable loop
// does (NaN and the sign of zero come out the same); the last n % 8
// channels go through masked loads and stores.
TAPEHOOK_AVX2 inline void ScaleByMaskBits(const uint8_t* bits, int64_t n,
                                          float* g) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    _mm256_storeu_ps(
        g + c, _mm256_mul_ps(_mm256_loadu_ps(g + c), MaskFactors(bits, c, n)));
  }
  if (c == n) return;
  const __m256i mask = TailMask(n - c);
  _mm256_maskstore_ps(
      g + c, mask,
      _mm256_mul_ps(_mm256_maskload_ps(g + c, mask), MaskFactors(bits, c, n)));
}

// out[w] bit b = !(x[64 w + b] >= 0) for b < 64, c = count of values
// (sign(t) = -1 maps to bit 1; NaN too, as in Sign()). Bits past c are 0.
// With `thr` ([c]): the signs of x - thr, each difference rounded to float.
TAPEHOOK_AVX2 inline void PackSigns(const float* x, int64_t c, uint64_t* out,
                                    const float* thr = nullptr) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t w = 0; w * 64 < c; ++w) {
    uint64_t bits = 0;
    int64_t k = 0;
    for (; k + 8 <= 64 && w * 64 + k + 8 <= c; k += 8) {
      __m256 v = _mm256_loadu_ps(x + w * 64 + k);
      if (thr != nullptr)
        v = _mm256_sub_ps(v, _mm256_loadu_ps(thr + w * 64 + k));
      const int m = _mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NGE_UQ));
      bits |= static_cast<uint64_t>(m) << k;
    }
    for (; k < 64 && w * 64 + k < c; ++k) {
      const int64_t i = w * 64 + k;
      const float v = thr != nullptr ? x[i] - thr[i] : x[i];
      bits |= static_cast<uint64_t>(!(v >= 0.0f)) << k;
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
