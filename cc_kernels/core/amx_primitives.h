// Row primitives of the AMX kernels (amx_conv.cc): the exact bf16 split
// (amx_conv.h), bf16 signs, the masked stores of packed-input backprops,
// pair interleaving and transposes, each with an AVX-512 loop (compiled
// under TAPEHOOK_AMX) and a portable one.
#ifndef TAPEHOOK_CORE_AMX_PRIMITIVES_H_
#define TAPEHOOK_CORE_AMX_PRIMITIVES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx_runtime.h"
#include "estimator.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tapehook {
namespace amx {

constexpr uint16_t kOne = 0x3F80, kMinusOne = 0xBF80;  // bf16 +1, -1
// Same convention as the other kernels: sign(t) = +1 for t >= 0.
inline uint16_t SignBf16(float t) { return t >= 0 ? kOne : kMinusOne; }

inline uint32_t Bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}
inline float FromBits(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// v = hi + mid + lo exactly (bf16 parts by truncation, see amx_conv.h).
inline void Split3(float v, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  const uint32_t h = Bits(v) & 0xFFFF0000u;
  const float r = v - FromBits(h);
  const uint32_t m = Bits(r) & 0xFFFF0000u;
  *hi = static_cast<uint16_t>(h >> 16);
  *mid = static_cast<uint16_t>(m >> 16);
  *lo = static_cast<uint16_t>(Bits(r - FromBits(m)) >> 16);
}

// The bf16 nearest to v's 32 bits (ties to even), as the high half of a
// 32-bit word. v finite; a NaN or infinity only reaches it as the remainder
// of one whose hi part is already NaN or infinite.
inline uint32_t RoundToBf16Bits(uint32_t v) {
  return (v + 0x7FFFu + ((v >> 16) & 1u)) & 0xFFFF0000u;
}

// v ~ hi + mid, two bf16 parts (DySplit::kBf16x2, amx_conv.h):
// hi by truncation, mid the bf16 nearest to v - hi (exact in fp32), so
// |v - hi - mid| <= 2^-16 |v|.
inline void Split2(float v, uint16_t* hi, uint16_t* mid) {
  const uint32_t h = Bits(v) & 0xFFFF0000u;
  *hi = static_cast<uint16_t>(h >> 16);
  *mid = static_cast<uint16_t>(RoundToBf16Bits(Bits(v - FromBits(h))) >> 16);
}

// The parts of a float operand: 3 (exact, Split3) or 2 (Split2).
inline void SplitParts(float v, int parts, uint16_t* hi, uint16_t* mid,
                       uint16_t* lo) {
  if (parts == 2) return Split2(v, hi, mid);
  Split3(v, hi, mid, lo);
}

// out[0, n) = hi parts, out[kp, kp + n) = mid, out[2 kp, 2 kp + n) = lo of
// v[i] * scale[i] (scale may be null), `parts` (3 or 2) of them; zeros up
// to each kp.
inline void SplitRowPortable(const float* v, const float* scale, int64_t n,
                             int64_t kp, uint16_t* out, int parts = 3) {
  uint16_t unused;
  for (int64_t i = 0; i < n; ++i) {
    const float t = scale ? v[i] * scale[i] : v[i];
    SplitParts(t, parts, out + i, out + kp + i,
               parts == 3 ? out + 2 * kp + i : &unused);
  }
  for (int part = 0; part < parts; ++part) {
    std::fill(out + part * kp + n, out + (part + 1) * kp, uint16_t{0});
  }
}

#if TAPEHOOK_HAVE_AMX_PATH
// The three parts of 16 floats as the high halves of 32-bit lanes (hi and
// mid by masking, lo exact since r - mid fits in 8 bits); with parts == 2,
// hi and mid = r rounded to the nearest bf16 (Split2), lo untouched.
TAPEHOOK_AMX inline void Split16(__m512 t, __m512i* hi, __m512i* mid,
                                 __m512i* lo, int parts = 3) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  *hi = _mm512_and_si512(_mm512_castps_si512(t), top);
  const __m512 r = _mm512_sub_ps(t, _mm512_castsi512_ps(*hi));
  if (parts == 2) {
    const __m512i rb = _mm512_castps_si512(r);
    const __m512i odd =
        _mm512_and_si512(_mm512_srli_epi32(rb, 16), _mm512_set1_epi32(1));
    *mid = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(rb, _mm512_set1_epi32(0x7FFF)), odd),
        top);
    return;
  }
  *mid = _mm512_and_si512(_mm512_castps_si512(r), top);
  *lo = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(*mid)));
}

// 32 values at a time: one vpermt2w gathers the high halves of two vectors'
// lanes into 32 bf16 (cheaper than two narrowing moves). kp % 32 == 0.
TAPEHOOK_AMX inline void SplitRow512(const float* v, const float* scale,
                                     int64_t n, int64_t kp, uint16_t* out,
                                     int parts = 3) {
  __m512i high_halves;
  {
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = static_cast<uint16_t>(2 * i + 1);
    high_halves = _mm512_load_si512(idx);
  }
  for (int64_t i = 0; i < kp; i += 32) {
    __m512 t[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t b = i + 16 * h;
      const __mmask16 m = b + 16 <= n
                              ? __mmask16(0xFFFF)
                              : __mmask16(b >= n ? 0 : (1u << (n - b)) - 1);
      t[h] = _mm512_maskz_loadu_ps(m, v + b);
      if (scale)
        t[h] = _mm512_mul_ps(t[h], _mm512_maskz_loadu_ps(m, scale + b));
    }
    __m512i p0[3], p1[3];
    Split16(t[0], &p0[0], &p0[1], &p0[2], parts);
    Split16(t[1], &p1[0], &p1[1], &p1[2], parts);
    for (int part = 0; part < parts; ++part) {
      _mm512_storeu_si512(
          out + part * kp + i,
          _mm512_permutex2var_epi16(p0[part], high_halves, p1[part]));
    }
  }
}
#endif

inline void SplitRow(const float* v, const float* scale, int64_t n, int64_t kp,
                     uint16_t* out, int parts = 3) {
#if TAPEHOOK_HAVE_AMX_PATH
  if (kp % 32 == 0) return SplitRow512(v, scale, n, kp, out, parts);
#endif
  SplitRowPortable(v, scale, n, kp, out, parts);
}

// out[0, 32) = bf16 sign of v[c] for c < n (n <= 32), then zeros.
inline void SignRowPortable(const float* v, int64_t n, uint16_t* out) {
  for (int64_t c = 0; c < 32; ++c) out[c] = c < n ? SignBf16(v[c]) : 0;
}

#if TAPEHOOK_HAVE_AMX_PATH
TAPEHOOK_AMX inline void SignRow512(const float* v, int64_t n, uint16_t* out) {
  const __m512i one = _mm512_set1_epi16(static_cast<short>(kOne));
  const __m512i minus_one = _mm512_set1_epi16(static_cast<short>(kMinusOne));
  uint32_t ge = 0;  // bit c: v[c] >= 0
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t left =
        std::max<int64_t>(0, std::min<int64_t>(16, n - 16 * h));
    const __mmask16 m = static_cast<__mmask16>((uint32_t{1} << left) - 1);
    const __m512 t = _mm512_maskz_loadu_ps(m, v + 16 * h);
    ge |=
        uint32_t{_mm512_mask_cmp_ps_mask(m, t, _mm512_setzero_ps(), _CMP_GE_OQ)}
        << (16 * h);
  }
  const __mmask32 valid =
      static_cast<__mmask32>(n >= 32 ? 0xFFFFFFFFu : (uint32_t{1} << n) - 1);
  const __m512i signs = _mm512_mask_blend_epi16(ge, minus_one, one);
  _mm512_storeu_si512(out, _mm512_maskz_mov_epi16(valid, signs));
}
#endif

// kSignQuad[b]: the four bf16 signs of packed byte b, channel i in bits
// [16 i, 16 i + 16) (little-endian: out[i] once stored).
struct SignQuadTable {
  uint64_t v[256];
  constexpr SignQuadTable() : v() {
    for (unsigned b = 0; b < 256; ++b) {
      uint64_t q = 0;
      for (unsigned i = 0; i < 4; ++i) {
        const unsigned bit = (b >> (7 - 2 * i)) & 1u;
        q |= uint64_t{static_cast<uint16_t>(kMinusOne ^ (bit << 15))}
             << (16 * i);
      }
      v[b] = q;
    }
  }
};
inline constexpr SignQuadTable kSignQuad{};

// out[0, 32) = bf16 sign of channels [c0, c0 + n) from packed sign bits
// (pack_input.h: channel c is bit 7 - 2 (c % 4) of byte c / 4), then zeros.
[[maybe_unused]] inline void SignRowFromBits(const uint8_t* bits, int64_t c0,
                                             int64_t n, uint16_t* out) {
  // Whole bytes by table (c0 is a multiple of 4); then -1 with its sign bit
  // flipped where the sign bit is set, branch-free.
  int64_t j = 0;
  if (c0 % 4 == 0) {
    for (; j + 4 <= n; j += 4) {
      std::memcpy(out + j, &kSignQuad.v[bits[(c0 + j) >> 2]], 8);
    }
  }
  for (; j < n; ++j) {
    const int64_t c = c0 + j;
    const unsigned bit = (bits[c >> 2] >> (7 - 2 * (c & 3))) & 1u;
    out[j] = static_cast<uint16_t>(kMinusOne ^ (bit << 15));
  }
  std::fill(out + n, out + 32, uint16_t{0});
}

// dst[j] = (j < 16 ? left[j] : right[j - 16]), or +0 where the mask bit of
// channel j is clear, j < n <= 32; bits starts at a multiple of 4 channels
// (bit 6 - 2 (j % 4) of byte j / 4). Branch-free: the mask bits of normal
// activations are close to random.
inline void StoreMaskedRowPortable(const float* left, const float* right,
                                   int64_t n, const uint8_t* bits, float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t keep =
        0u - ((static_cast<uint32_t>(bits[j >> 2]) >> (6 - 2 * (j & 3))) & 1u);
    dst[j] = FromBits(Bits(j < 16 ? left[j] : right[j - 16]) & keep);
  }
}

#if TAPEHOOK_HAVE_AMX_PATH
// kMaskNibble[b]: the four mask bits of packed byte b, channel i at bit i.
struct MaskNibbles {
  uint8_t v[256];
  MaskNibbles() {
    for (int b = 0; b < 256; ++b) {
      v[b] = static_cast<uint8_t>((b >> 6 & 1) | (b >> 4 & 1) << 1 |
                                  (b >> 2 & 1) << 2 | (b & 1) << 3);
    }
  }
};
inline const MaskNibbles kMaskNibble;

TAPEHOOK_AMX inline void StoreMaskedRow512(const float* left,
                                           const float* right, int64_t n,
                                           const uint8_t* bits, float* dst) {
  uint32_t keep = 0;
  for (int64_t b = 0; b < (n + 3) / 4; ++b) {  // only the bytes of the row
    keep |= uint32_t{kMaskNibble.v[bits[b]]} << (4 * b);
  }
  keep &= n >= 32 ? 0xFFFFFFFFu : (1u << n) - 1;
  const __mmask16 lo = static_cast<__mmask16>(keep);
  const __mmask16 hi = static_cast<__mmask16>(keep >> 16);
  const __mmask16 lo_n =
      static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  const __mmask16 hi_n = static_cast<__mmask16>(n >= 32  ? 0xFFFF
                                                : n > 16 ? (1u << (n - 16)) - 1
                                                         : 0);
  _mm512_mask_storeu_ps(dst, lo_n, _mm512_maskz_loadu_ps(lo, left));
  if (hi_n)
    _mm512_mask_storeu_ps(dst + 16, hi_n, _mm512_maskz_loadu_ps(hi, right));
}
#endif

inline void StoreMaskedRow(const float* left, const float* right, int64_t n,
                           const uint8_t* bits, float* dst) {
#if TAPEHOOK_HAVE_AMX_PATH
  return StoreMaskedRow512(left, right, n, bits, dst);
#endif
  StoreMaskedRowPortable(left, right, n, bits, dst);
}

[[maybe_unused]] inline void SignRow(const float* v, int64_t n, uint16_t* out) {
#if TAPEHOOK_HAVE_AMX_PATH
  return SignRow512(v, n, out);
#endif
  SignRowPortable(v, n, out);
}

// out[i][base + 2 o + e] = part i of row e's value o (rows may be null:
// zeros), for o < n_pad; values past n are zero.
inline void InterleaveSplitPairPortable(const float* r0, const float* r1,
                                        int64_t n, int64_t n_pad, int64_t base,
                                        uint16_t* const* out, int parts = 3) {
  for (int64_t o = 0; o < n_pad; ++o) {
    for (int e = 0; e < 2; ++e) {
      const float* r = e == 0 ? r0 : r1;
      uint16_t part[3] = {0, 0, 0};
      if (r != nullptr && o < n) {
        SplitParts(r[o], parts, &part[0], &part[1], &part[2]);
      }
      for (int i = 0; i < parts; ++i) out[i][base + 2 * o + e] = part[i];
    }
  }
}

#if TAPEHOOK_HAVE_AMX_PATH
// The AVX-512 version: a pair's bf16 parts form one 32-bit word
// (row 1's part << 16 | row 0's part), so no shuffles are needed.
TAPEHOOK_AMX inline void InterleaveSplitPair512(const float* r0,
                                                const float* r1, int64_t n,
                                                int64_t n_pad, int64_t base,
                                                uint16_t* const* out,
                                                int parts = 3) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t o = 0; o < n_pad; o += 16) {
    const __mmask16 m = o + 16 <= n
                            ? __mmask16(0xFFFF)
                            : __mmask16(o >= n ? 0 : (1u << (n - o)) - 1);
    __m512i part[2][3];
    for (int e = 0; e < 2; ++e) {
      const float* r = e == 0 ? r0 : r1;
      const __m512 t =
          r ? _mm512_maskz_loadu_ps(m, r + o) : _mm512_setzero_ps();
      __m512i lb = _mm512_setzero_si512();
      Split16(t, &part[e][0], &part[e][1], &lb, parts);
      part[e][2] = _mm512_and_si512(lb, top);
    }
    for (int i = 0; i < parts; ++i) {
      const __m512i word =
          _mm512_or_si512(_mm512_srli_epi32(part[0][i], 16), part[1][i]);
      _mm512_storeu_si512(out[i] + base + 2 * o, word);
    }
  }
}
#endif

[[maybe_unused]] inline void InterleaveSplitPair(const float* r0,
                                                 const float* r1, int64_t n,
                                                 int64_t n_pad, int64_t base,
                                                 uint16_t* const* out,
                                                 int parts = 3) {
#if TAPEHOOK_HAVE_AMX_PATH
  if (n_pad % 16 == 0) {
    return InterleaveSplitPair512(r0, r1, n, n_pad, base, out, parts);
  }
#endif
  InterleaveSplitPairPortable(r0, r1, n, n_pad, base, out, parts);
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for an 8 x 8 block of 16-bit
// values: three rounds of interleaves (SSE2, the x86-64 baseline).
inline void Transpose8x8(const uint16_t* src, int64_t ld_src, uint16_t* dst,
                         int64_t ld_dst) {
#if defined(__SSE2__)
  __m128i r[8], a[8], b[8];
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
  }
  for (int i = 0; i < 4; ++i) {  // a[2i]: rows 2i, 2i+1 of columns 0-3
    a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // b[4h + j]: rows 4h..4h+3, columns 2j, 2j+1
    b[4 * h + 0] = _mm_unpacklo_epi32(a[4 * h], a[4 * h + 2]);
    b[4 * h + 1] = _mm_unpackhi_epi32(a[4 * h], a[4 * h + 2]);
    b[4 * h + 2] = _mm_unpacklo_epi32(a[4 * h + 1], a[4 * h + 3]);
    b[4 * h + 3] = _mm_unpackhi_epi32(a[4 * h + 1], a[4 * h + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * j) * ld_dst),
                     _mm_unpacklo_epi64(b[j], b[4 + j]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * j + 1) * ld_dst),
                     _mm_unpackhi_epi64(b[j], b[4 + j]));
  }
#else
  for (int c = 0; c < 8; ++c) {
    for (int r = 0; r < 8; ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
#endif
}

// out[2 i + e] = (e ? r1 : r0)[i] for i < 16 (SSE2).
inline void InterleaveRows16(const uint16_t* r0, const uint16_t* r1,
                             uint16_t* out) {
#if defined(__SSE2__)
  for (int h = 0; h < 2; ++h) {
    const __m128i a =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 8 * h));
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + 8 * h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h),
                     _mm_unpacklo_epi16(a, b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h + 8),
                     _mm_unpackhi_epi16(a, b));
  }
#else
  for (int i = 0; i < 16; ++i) out[2 * i] = r0[i], out[2 * i + 1] = r1[i];
#endif
}

inline float ActGrad(Estimator e, float x, double clip) {
  if (e == Estimator::kNone) return 1.0f;
  if (e == Estimator::kSteSign) return std::abs(x) <= clip ? 1.0f : 0.0f;
  if (e == Estimator::kApproxSign) return ApproxSignGrad(x);
  return static_cast<float>(EstimatorGrad(e, x, clip));
}

// dst[k] = src[k] * scale[k] [* 1{|w[k]| <= clip} when clip >= 0], k < n
// (n <= 16): one row segment of dW.
inline void ScaleAndMaskPortable(const float* src, const float* scale,
                                 const float* w, float clip, int64_t n,
                                 float* dst) {
  for (int64_t k = 0; k < n; ++k) {
    const float v = src[k] * scale[k];
    dst[k] = clip < 0 || std::abs(w[k]) <= clip ? v : 0.0f;
  }
}

#if TAPEHOOK_HAVE_AMX_PATH
TAPEHOOK_AMX inline void ScaleAndMask512(const float* src, const float* scale,
                                         const float* w, float clip, int64_t n,
                                         float* dst) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src),
                           _mm512_maskz_loadu_ps(m, scale));
  if (clip >= 0) {
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, w));
    v = _mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(a, _mm512_set1_ps(clip), _CMP_LE_OQ), v);
  }
  _mm512_mask_storeu_ps(dst, m, v);
}
#endif

[[maybe_unused]] inline void ScaleAndMask(const float* src, const float* scale,
                                          const float* w, float clip, int64_t n,
                                          float* dst) {
#if TAPEHOOK_HAVE_AMX_PATH
  return ScaleAndMask512(src, scale, w, clip, n, dst);
#endif
  ScaleAndMaskPortable(src, scale, w, clip, n, dst);
}

}  // namespace amx
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_AMX_PRIMITIVES_H_
