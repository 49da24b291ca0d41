#include "pack_input.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace tapehook {

namespace {

// Values per run of ShiftedRuns' buffer: a multiple of 4 (a packed byte's
// channels) and of 16 (a vector).
constexpr int64_t kShiftRun = 1024;

// run(values, count, at) over elements [lo, hi) of x, whose last axis has
// `channels` values: x + lo itself where threshold is null, else x -
// threshold[channel] (rounded to T, as a separate subtraction rounds it) in
// runs of a local buffer that never cross a row or pass kShiftRun values, so
// the shifted input is never written out whole.
template <typename T, typename Run>
void ShiftedRuns(const T* x, int64_t lo, int64_t hi, const T* threshold,
                 int64_t channels, Run run) {
  if (threshold == nullptr) return run(x + lo, hi - lo, lo);
  T buffer[kShiftRun];
  for (int64_t i = lo; i < hi;) {
    const int64_t c = i % channels;
    const int64_t n = std::min({hi - i, channels - c, kShiftRun});
    for (int64_t j = 0; j < n; ++j) buffer[j] = x[i + j] - threshold[c + j];
    run(buffer, n, i);
    i += n;
  }
}

// One row: byte c / 4 holds channels 4 (c / 4) .. + 3, channel c's sign at
// bit 7 - 2 (c % 4) and its mask just below.
template <typename T>
void PackRowPortable(const T* in, int64_t channels, T limit, uint8_t* out) {
  for (int64_t b = 0; b * 4 < channels; ++b) {
    unsigned byte = 0;
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t c = 4 * b + i;
      const unsigned bits =
          c < channels ? ((in[c] >= T(0)) << 1) | (std::abs(in[c]) <= limit)
                       : 0;
      byte |= bits << (6 - 2 * i);
    }
    out[b] = static_cast<uint8_t>(byte);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TAPEHOOK_HAVE_PACK512 1
// kPairReversed[v]: the four 2-bit groups of v in reverse order.
struct PairReverseTable {
  uint8_t v[256];
  PairReverseTable() {
    for (int i = 0; i < 256; ++i) {
      v[i] = static_cast<uint8_t>(((i & 3) << 6) | ((i >> 2 & 3) << 4) |
                                  ((i >> 4 & 3) << 2) | (i >> 6 & 3));
    }
  }
};
const PairReverseTable kPairReversed;

// 16 channels at a time: the sign and mask compares give 16-bit masks, pdep
// interleaves them into (sign, mask) pairs, the table puts each byte's four
// pairs in the format's order.
__attribute__((target("avx512f,bmi2"))) void PackRow512(const float* in,
                                                        int64_t channels,
                                                        float limit,
                                                        uint8_t* out) {
  const __m512 lim = _mm512_set1_ps(limit);
  const __m512i abs_bits = _mm512_set1_epi32(0x7FFFFFFF);
  int64_t c = 0;
  for (; c + 16 <= channels; c += 16) {
    const __m512 v = _mm512_loadu_ps(in + c);
    const unsigned sign =
        _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 a =
        _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_bits));
    const unsigned mask = _mm512_cmp_ps_mask(a, lim, _CMP_LE_OQ);
    const uint32_t pairs =
        _pdep_u32(sign, 0xAAAAAAAAu) | _pdep_u32(mask, 0x55555555u);
    for (int j = 0; j < 4; ++j) {
      out[c / 4 + j] = kPairReversed.v[(pairs >> (8 * j)) & 0xFF];
    }
  }
  PackRowPortable(in + c, channels - c, limit, out + c / 4);
}
#else
#define TAPEHOOK_HAVE_PACK512 0
#endif

}  // namespace

template <typename T>
void PackSignMask(const T* x, int64_t rows, int64_t channels, double clip,
                  uint8_t* packed, const ParallelFor& parallel_for,
                  const T* threshold) {
  const int64_t bytes = PackedBytes(channels);
  const T limit = static_cast<T>(clip);
  bool wide = false;
#if TAPEHOOK_HAVE_PACK512
  wide = std::is_same<T, float>::value && cpu::PackInput512();
#endif
  // Runs of whole bytes (kShiftRun is a multiple of 4) of a row.
  auto pack = [&](const T* in, int64_t n, int64_t at) {
    uint8_t* out = packed + (at / channels) * bytes + (at % channels) / 4;
#if TAPEHOOK_HAVE_PACK512
    if constexpr (std::is_same<T, float>::value) {
      if (wide) return PackRow512(in, n, limit, out);
    }
#endif
    PackRowPortable(in, n, limit, out);
  };
  parallel_for(rows, channels * 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      ShiftedRuns(x, r * channels, (r + 1) * channels, threshold, channels,
                  pack);
    }
  });
}

namespace {

template <typename T>
void UnpackRowPortable(const uint8_t* in, int64_t channels, T* x_hat, T* mask) {
  for (int64_t c = 0; c < channels; ++c) {
    const int bits = (in[c / 4] >> (6 - 2 * static_cast<int>(c % 4))) & 3;
    x_hat[c] = (bits & 2) ? T(1) : T(-1);
    if (mask != nullptr) mask[c] = (bits & 1) ? T(1) : T(0);
  }
}

#if TAPEHOOK_HAVE_PACK512
// kNibbles[b]: the four sign bits (low nibble) and four mask bits (high
// nibble) of packed byte b, channel i at bit i of each nibble.
struct UnpackTable {
  uint8_t v[256];
  UnpackTable() {
    for (int b = 0; b < 256; ++b) {
      int sign = 0, mask = 0;
      for (int i = 0; i < 4; ++i) {
        sign |= (b >> (7 - 2 * i) & 1) << i;
        mask |= (b >> (6 - 2 * i) & 1) << i;
      }
      v[b] = static_cast<uint8_t>(sign | mask << 4);
    }
  }
};
const UnpackTable kNibbles;

__attribute__((target("avx512f"))) void UnpackRow512(const uint8_t* in,
                                                     int64_t channels,
                                                     float* x_hat,
                                                     float* mask) {
  const __m512 one = _mm512_set1_ps(1.0f), minus_one = _mm512_set1_ps(-1.0f);
  int64_t c = 0;
  for (; c + 16 <= channels; c += 16) {
    unsigned sign = 0, keep = 0;
    for (int j = 0; j < 4; ++j) {
      const unsigned n = kNibbles.v[in[c / 4 + j]];
      sign |= (n & 15u) << (4 * j);
      keep |= (n >> 4) << (4 * j);
    }
    _mm512_storeu_ps(
        x_hat + c,
        _mm512_mask_blend_ps(static_cast<__mmask16>(sign), minus_one, one));
    if (mask != nullptr) {
      _mm512_storeu_ps(mask + c,
                       _mm512_maskz_mov_ps(static_cast<__mmask16>(keep), one));
    }
  }
  UnpackRowPortable(in + c / 4, channels - c, x_hat + c,
                    mask != nullptr ? mask + c : nullptr);
}
#endif

}  // namespace

template <typename T>
void UnpackSignMask(const uint8_t* packed, int64_t rows, int64_t channels,
                    T* x_hat, T* mask, const ParallelFor& parallel_for) {
  const int64_t bytes = PackedBytes(channels);
  bool wide = false;
#if TAPEHOOK_HAVE_PACK512
  wide = std::is_same<T, float>::value && cpu::UnpackInput512();
#endif
  parallel_for(rows, channels * 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if TAPEHOOK_HAVE_PACK512
      if constexpr (std::is_same<T, float>::value) {
        if (wide) {
          UnpackRow512(packed + r * bytes, channels, x_hat + r * channels,
                       mask != nullptr ? mask + r * channels : nullptr);
          continue;
        }
      }
#endif
      UnpackRowPortable(packed + r * bytes, channels, x_hat + r * channels,
                        mask != nullptr ? mask + r * channels : nullptr);
    }
  });
}

uint16_t FloatToHalf(float value) {
  uint32_t x;
  std::memcpy(&x, &value, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);   // NaN
  if (a >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7C00u);  // inf
  if (a < 0x38800000u) {
    // Below 2^-14 (binary16 subnormals): adding 0.5f rounds |value| to a
    // multiple of 0.5f's ulp, 2^-24, the subnormal step, to nearest even;
    // the low bits of the sum are then the subnormal's mantissa (0x400: the
    // smallest normal, also the right encoding).
    float v;
    std::memcpy(&v, &a, sizeof(v));
    v += 0.5f;
    uint32_t r;
    std::memcpy(&r, &v, sizeof(r));
    return static_cast<uint16_t>(sign | (r - 0x3F000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to
  // nearest even; a carry into the exponent (or to 0x7C00, inf) is right.
  const uint32_t rounded = a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

float HalfToFloat(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t e = (half >> 10) & 0x1Fu, m = half & 0x3FFu;
  uint32_t bits;
  if (e == 0x1F) {
    bits = sign | 0x7F800000u | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);
  } else {
    // Zero or subnormal: m * 2^-24, exact in float32.
    const float v = static_cast<float>(m) * 0x1p-24f;
    std::memcpy(&bits, &v, sizeof(bits));
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

namespace {

float GradOf(Estimator estimator, float t) {
  return estimator == Estimator::kApproxSign
             ? ApproxSignGrad(t)
             : static_cast<float>(EstimatorGrad(estimator, t, 0.0));
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TAPEHOOK_HAVE_HALF_SIMD 1
// approx_sign's e'(t) = 2 - 2 min(|t|, 1) of 16 / 8 values at t, on the bit
// patterns as ApproxSignGrad (NaN: 1, so e' = 0): 2m is exact, one rounding.
__attribute__((target("avx512f"))) inline __m512 ApproxGrad512(const float* t) {
  const __m512i a =
      _mm512_and_si512(_mm512_loadu_si512(t), _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 m =
      _mm512_castsi512_ps(_mm512_min_epi32(a, _mm512_set1_epi32(0x3F800000)));
  const __m512 two = _mm512_set1_ps(2.0f);
  return _mm512_fnmadd_ps(two, m, two);
}

__attribute__((target("avx2,fma"))) inline __m256 ApproxGrad256(
    const float* t) {
  const __m256i a =
      _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)),
                       _mm256_set1_epi32(0x7FFFFFFF));
  const __m256 m =
      _mm256_castsi256_ps(_mm256_min_epi32(a, _mm256_set1_epi32(0x3F800000)));
  const __m256 two = _mm256_set1_ps(2.0f);
  return _mm256_fnmadd_ps(two, m, two);
}

// approx_sign's e' in binary16: vcvtps2ph (to nearest even).
__attribute__((target("avx512f"))) void ApproxHalf512(const float* x, int64_t n,
                                                      uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = ApproxGrad512(x + i);
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(out + i),
        _mm512_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) out[i] = FloatToHalf(ApproxSignGrad(x[i]));
}

__attribute__((target("avx2,f16c,fma"))) void ApproxHalf256(const float* x,
                                                            int64_t n,
                                                            uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = ApproxGrad256(x + i);
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(out + i),
        _mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) out[i] = FloatToHalf(ApproxSignGrad(x[i]));
}

__attribute__((target("avx512f"))) void ScaleHalf512(const float* grad,
                                                     const uint16_t* half,
                                                     int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 h = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + i)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(grad + i), h));
  }
  for (; i < n; ++i) out[i] = grad[i] * HalfToFloat(half[i]);
}

__attribute__((target("avx2,f16c"))) void ScaleHalf256(const float* grad,
                                                       const uint16_t* half,
                                                       int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 h = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(half + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(grad + i), h));
  }
  for (; i < n; ++i) out[i] = grad[i] * HalfToFloat(half[i]);
}
#else
#define TAPEHOOK_HAVE_HALF_SIMD 0
#endif

// Elements per ParallelFor unit (and its cost): whole vectors per unit.
constexpr int64_t kHalfBlock = 4096;

// fn(lo, hi) over [0, n), kHalfBlock elements per ParallelFor unit.
template <typename Fn>
void ForHalfBlocks(int64_t n, const ParallelFor& parallel_for, Fn fn) {
  const int64_t blocks = (n + kHalfBlock - 1) / kHalfBlock;
  parallel_for(blocks, kHalfBlock * 2, [&](int64_t begin, int64_t end) {
    fn(begin * kHalfBlock, std::min(end * kHalfBlock, n));
  });
}

// The binary16 loops' tier: 0 portable, 1 F16C, 2 AVX-512F.
int HalfTier() {
#if TAPEHOOK_HAVE_HALF_SIMD
  return cpu::UnpackInput512() ? 2 : cpu::HalfConvert256() ? 1 : 0;
#else
  return 0;
#endif
}

}  // namespace

void EstimatorGradHalf(const float* x, int64_t n, Estimator estimator,
                       uint16_t* half, const ParallelFor& parallel_for,
                       const float* threshold, int64_t channels) {
  // The vector loops compute approx_sign's e'; swish_sign's is per element.
  const int tier = estimator == Estimator::kApproxSign ? HalfTier() : 0;
  auto run = [&](const float* in, int64_t count, int64_t at) {
    uint16_t* out = half + at;
#if TAPEHOOK_HAVE_HALF_SIMD
    if (tier == 2) return ApproxHalf512(in, count, out);
    if (tier == 1) return ApproxHalf256(in, count, out);
#endif
    for (int64_t i = 0; i < count; ++i) {
      out[i] = FloatToHalf(GradOf(estimator, in[i]));
    }
  };
  ForHalfBlocks(n, parallel_for, [&](int64_t lo, int64_t hi) {
    ShiftedRuns(x, lo, hi, threshold, channels, run);
  });
}

void ScaleByHalf(const float* grad, const uint16_t* half, int64_t n, float* out,
                 const ParallelFor& parallel_for) {
  const int tier = HalfTier();
  ForHalfBlocks(n, parallel_for, [&](int64_t lo, int64_t hi) {
#if TAPEHOOK_HAVE_HALF_SIMD
    if (tier == 2) return ScaleHalf512(grad + lo, half + lo, hi - lo, out + lo);
    if (tier == 1) return ScaleHalf256(grad + lo, half + lo, hi - lo, out + lo);
#endif
    for (int64_t i = lo; i < hi; ++i) out[i] = grad[i] * HalfToFloat(half[i]);
  });
}

namespace {

constexpr float kApproxQuantum = 32767.5f;  // 65535 / 2, exact in float32
constexpr double kSwishBeta = 5.0;
constexpr int32_t kSwishOffset = 4520;
constexpr double kSwishSteps = 61015.0;  // per beta

uint16_t ApproxFixed(float x) {
  const float q = std::nearbyint(ApproxSignGrad(x) * kApproxQuantum);
  return static_cast<uint16_t>(q);  // in [0, 65535]: e' in [0, 2]
}

uint16_t SwishFixed(float x) {
  const double d = EstimatorGrad(Estimator::kSwishSign, x, 0.0);
  if (!(d == d)) return kSwishOffset;
  const double q =
      std::nearbyint(d * (kSwishSteps / kSwishBeta)) + kSwishOffset;
  return static_cast<uint16_t>(std::min(65535.0, std::max(0.0, q)));
}

// e' = (q - offset) * step: exact integers, one float32 rounding (the
// vector loops compute it in the same order).
float FixedValue(uint16_t q, FixedDerivative f) {
  return static_cast<float>(int32_t{q} - f.offset) * f.step;
}

#if TAPEHOOK_HAVE_HALF_SIMD
// approx_sign's q: e' (ApproxGrad512), times 32767.5, vcvtps2dq (to nearest
// even under the default MXCSR), narrowed with unsigned saturation.
__attribute__((target("avx512f"))) void ApproxFixed512(const float* x,
                                                       int64_t n,
                                                       uint16_t* out) {
  const __m512 quantum = _mm512_set1_ps(kApproxQuantum);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i q =
        _mm512_cvtps_epi32(_mm512_mul_ps(ApproxGrad512(x + i), quantum));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtusepi32_epi16(q));
  }
  for (; i < n; ++i) out[i] = ApproxFixed(x[i]);
}

__attribute__((target("avx2,fma"))) void ApproxFixed256(const float* x,
                                                        int64_t n,
                                                        uint16_t* out) {
  const __m256 quantum = _mm256_set1_ps(kApproxQuantum);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i q =
        _mm256_cvtps_epi32(_mm256_mul_ps(ApproxGrad256(x + i), quantum));
    // packus works per 128-bit lane: gather the two low quarters.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(q, q),
                                                    _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_castsi256_si128(packed));
  }
  for (; i < n; ++i) out[i] = ApproxFixed(x[i]);
}

__attribute__((target("avx512f"))) void ScaleFixed512(const float* grad,
                                                      const uint16_t* q,
                                                      int64_t n,
                                                      FixedDerivative f,
                                                      float* out) {
  const __m512i offset = _mm512_set1_epi32(f.offset);
  const __m512 step = _mm512_set1_ps(f.step);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i v = _mm512_sub_epi32(
        _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i))),
        offset);
    const __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(v), step);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(grad + i), d));
  }
  for (; i < n; ++i) out[i] = grad[i] * FixedValue(q[i], f);
}

__attribute__((target("avx2"))) void ScaleFixed256(const float* grad,
                                                   const uint16_t* q, int64_t n,
                                                   FixedDerivative f,
                                                   float* out) {
  const __m256i offset = _mm256_set1_epi32(f.offset);
  const __m256 step = _mm256_set1_ps(f.step);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_sub_epi32(
        _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))),
        offset);
    const __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(v), step);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(grad + i), d));
  }
  for (; i < n; ++i) out[i] = grad[i] * FixedValue(q[i], f);
}
#endif

}  // namespace

FixedDerivative FixedDerivativeOf(Estimator estimator) {
  if (estimator == Estimator::kSwishSign) {
    return {kSwishOffset, static_cast<float>(kSwishBeta / kSwishSteps)};
  }
  return {0, static_cast<float>(1.0 / kApproxQuantum)};  // 2 / 65535
}

void EstimatorGradFixed(const float* x, int64_t n, Estimator estimator,
                        uint16_t* q, const ParallelFor& parallel_for,
                        const float* threshold, int64_t channels) {
  // The vector loops compute approx_sign's q; swish_sign's is per element.
  const bool approx = estimator == Estimator::kApproxSign;
  const int tier = approx ? HalfTier() : 0;
  auto run = [&](const float* in, int64_t count, int64_t at) {
    uint16_t* out = q + at;
#if TAPEHOOK_HAVE_HALF_SIMD
    if (tier == 2) return ApproxFixed512(in, count, out);
    if (tier == 1) return ApproxFixed256(in, count, out);
#endif
    for (int64_t i = 0; i < count; ++i) {
      out[i] = approx ? ApproxFixed(in[i]) : SwishFixed(in[i]);
    }
  };
  ForHalfBlocks(n, parallel_for, [&](int64_t lo, int64_t hi) {
    ShiftedRuns(x, lo, hi, threshold, channels, run);
  });
}

void ScaleByFixed(const float* grad, const uint16_t* q, int64_t n,
                  Estimator estimator, float* out,
                  const ParallelFor& parallel_for) {
  const FixedDerivative f = FixedDerivativeOf(estimator);
  const int tier = HalfTier();
  ForHalfBlocks(n, parallel_for, [&](int64_t lo, int64_t hi) {
#if TAPEHOOK_HAVE_HALF_SIMD
    if (tier == 2)
      return ScaleFixed512(grad + lo, q + lo, hi - lo, f, out + lo);
    if (tier == 1)
      return ScaleFixed256(grad + lo, q + lo, hi - lo, f, out + lo);
#endif
    for (int64_t i = lo; i < hi; ++i) out[i] = grad[i] * FixedValue(q[i], f);
  });
}

template void PackSignMask<float>(const float*, int64_t, int64_t, double,
                                  uint8_t*, const ParallelFor&, const float*);
template void PackSignMask<double>(const double*, int64_t, int64_t, double,
                                   uint8_t*, const ParallelFor&, const double*);
template void UnpackSignMask<float>(const uint8_t*, int64_t, int64_t, float*,
                                    float*, const ParallelFor&);
template void UnpackSignMask<double>(const uint8_t*, int64_t, int64_t, double*,
                                     double*, const ParallelFor&);

}  // namespace tapehook
