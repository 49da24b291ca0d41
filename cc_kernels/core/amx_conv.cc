// AMX kernels for the float-operand binary convolutions (see amx_conv.h for
// the bf16 split that keeps them exact).
//
// Layout. A stride-1 convolution reads, for output pixel (n, oh, ow) and tap
// (kh, kw), the padded input pixel (n, oh + kh * dil_h, ow + kw * dil_w).
// Flatten each padded image row-major into one "q grid" (plane = hp * wp
// rows per image) and put output pixel (n, oh, ow) at q = n * plane +
// oh * wp + ow: then tap t reads grid row q + off[t], off[t] = kh * dil_h *
// wp + kw * dil_w, for every output pixel alike. A tile of 16 consecutive q
// is then a 16-row strided block of the padded input, which is exactly what
// an AMX tile load reads, so the convolution is a GEMM over shifted row
// blocks with no im2col copy. Grid positions that are not output pixels
// (ow >= out_w, oh >= out_h) are computed and dropped.
#include "amx_conv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "pack_input.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__x86_64__) && defined(__linux__) &&                     \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
     (defined(__clang__) && __clang_major__ >= 12))
#define TAPEHOOK_HAVE_AMX_PATH 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TAPEHOOK_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")))
// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_*) when
// they are inlined at -O2; a false positive, silenced for this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#else
#define TAPEHOOK_HAVE_AMX_PATH 0
#endif

namespace tapehook {
namespace amx {
namespace {

bool CpuAndOsReady() {
#if TAPEHOOK_HAVE_AMX_PATH
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!tile || !bf16 || !__builtin_cpu_supports("avx512f") ||
        !__builtin_cpu_supports("avx512bw")) {
      return false;
    }
    // Linux hands out the 8 KiB tile state only on request (per process).
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

// Scratch memory is recycled between calls: a fresh multi-MiB block costs a
// page fault per 4 KiB on first touch (about 2 us each in a VM), as much as
// the convolution itself. Blocks are returned to this pool when a call ends
// and handed out again best-fit; at most kPoolBytes stay cached.
class ScratchPool {
 public:
  static constexpr size_t kPoolBytes = size_t{512} << 20;

  void* Take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      size_t best = free_.size();
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].first >= bytes &&
            (best == free_.size() || free_[i].first < free_[best].first)) {
          best = i;
        }
      }
      if (best < free_.size()) {
        void* p = free_[best].second;
        cached_ -= free_[best].first;
        free_.erase(free_.begin() + best);
        return p;
      }
    }
    return std::aligned_alloc(64, bytes);
  }

  void Give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace_back(bytes, p);
    cached_ += bytes;
    while (cached_ > kPoolBytes) {  // drop the smallest blocks first
      auto it = std::min_element(free_.begin(), free_.end());
      cached_ -= it->first;
      std::free(it->second);
      free_.erase(it);
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<size_t, void*>> free_;
  size_t cached_ = 0;
};

ScratchPool& Pool() {
  static ScratchPool* pool = new ScratchPool;  // never destroyed: no exit races
  return *pool;
}

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// n bf16 values of scratch, 64-byte aligned, contents undefined.
struct Buffer {
  explicit Buffer(int64_t n)
      : bytes(RoundUp(std::max<int64_t>(n, 1) * 2, 4096)),
        p(static_cast<uint16_t*>(Pool().Take(bytes))) {}
  ~Buffer() { Pool().Give(p, bytes); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  size_t bytes;
  uint16_t* p;
};

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

// out[0, n) = hi parts, out[kp, kp + n) = mid, out[2 kp, 2 kp + n) = lo of
// v[i] * scale[i] (scale may be null); zeros up to each kp.
void SplitRowPortable(const float* v, const float* scale, int64_t n, int64_t kp,
                      uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float t = scale ? v[i] * scale[i] : v[i];
    Split3(t, out + i, out + kp + i, out + 2 * kp + i);
  }
  for (int part = 0; part < 3; ++part) {
    std::fill(out + part * kp + n, out + (part + 1) * kp, uint16_t{0});
  }
}

#if TAPEHOOK_HAVE_AMX_PATH
// The three parts of 16 floats as the high halves of 32-bit lanes (hi and
// mid by masking, lo exact since r - mid fits in 8 bits).
TAPEHOOK_AMX inline void Split16(__m512 t, __m512i* hi, __m512i* mid,
                                 __m512i* lo) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  *hi = _mm512_and_si512(_mm512_castps_si512(t), top);
  const __m512 r = _mm512_sub_ps(t, _mm512_castsi512_ps(*hi));
  *mid = _mm512_and_si512(_mm512_castps_si512(r), top);
  *lo = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(*mid)));
}

// 32 values at a time: one vpermt2w gathers the high halves of two vectors'
// lanes into 32 bf16 (cheaper than two narrowing moves). kp % 32 == 0.
TAPEHOOK_AMX void SplitRow512(const float* v, const float* scale, int64_t n,
                              int64_t kp, uint16_t* out) {
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
    Split16(t[0], &p0[0], &p0[1], &p0[2]);
    Split16(t[1], &p1[0], &p1[1], &p1[2]);
    for (int part = 0; part < 3; ++part) {
      _mm512_storeu_si512(
          out + part * kp + i,
          _mm512_permutex2var_epi16(p0[part], high_halves, p1[part]));
    }
  }
}
#endif

void SplitRow(const float* v, const float* scale, int64_t n, int64_t kp,
              uint16_t* out) {
#if TAPEHOOK_HAVE_AMX_PATH
  if (kp % 32 == 0) return SplitRow512(v, scale, n, kp, out);
#endif
  SplitRowPortable(v, scale, n, kp, out);
}

// out[0, 32) = bf16 sign of v[c] for c < n (n <= 32), then zeros.
void SignRowPortable(const float* v, int64_t n, uint16_t* out) {
  for (int64_t c = 0; c < 32; ++c) out[c] = c < n ? SignBf16(v[c]) : 0;
}

#if TAPEHOOK_HAVE_AMX_PATH
TAPEHOOK_AMX void SignRow512(const float* v, int64_t n, uint16_t* out) {
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

// out[0, 32) = bf16 sign of channels [c0, c0 + n) from packed sign bits
// (pack_input.h: channel c is bit 7 - 2 (c % 4) of byte c / 4), then zeros.
[[maybe_unused]] void SignRowFromBits(const uint8_t* bits, int64_t c0,
                                      int64_t n, uint16_t* out) {
  // Branch-free: -1 with its sign bit flipped where the sign bit is set.
  for (int64_t j = 0; j < n; ++j) {
    const int64_t c = c0 + j;
    const unsigned bit = (bits[c >> 2] >> (7 - 2 * (c & 3))) & 1u;
    out[j] = static_cast<uint16_t>(kMinusOne ^ (bit << 15));
  }
  std::fill(out + n, out + 32, uint16_t{0});
}

// out[j] = +0 where the mask bit of channel j is clear, j < n; bits starts
// at a multiple of 4 channels (bit 6 - 2 (j % 4) of byte j / 4). Branch-free:
// the mask bits of normal activations are close to random.
// dst[j] = (j < 16 ? left[j] : right[j - 16]), or +0 where the mask bit of
// channel j is clear, j < n <= 32; bits starts at a multiple of 4 channels
// (bit 6 - 2 (j % 4) of byte j / 4). Branch-free: the mask bits of normal
// activations are close to random.
void StoreMaskedRowPortable(const float* left, const float* right, int64_t n,
                            const uint8_t* bits, float* dst) {
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
const MaskNibbles kMaskNibble;

TAPEHOOK_AMX void StoreMaskedRow512(const float* left, const float* right,
                                    int64_t n, const uint8_t* bits,
                                    float* dst) {
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

void StoreMaskedRow(const float* left, const float* right, int64_t n,
                    const uint8_t* bits, float* dst) {
#if TAPEHOOK_HAVE_AMX_PATH
  return StoreMaskedRow512(left, right, n, bits, dst);
#endif
  StoreMaskedRowPortable(left, right, n, bits, dst);
}

[[maybe_unused]] void SignRow(const float* v, int64_t n, uint16_t* out) {
#if TAPEHOOK_HAVE_AMX_PATH
  return SignRow512(v, n, out);
#endif
  SignRowPortable(v, n, out);
}

// out[i][base + 2 o + e] = part i of row e's value o (rows may be null:
// zeros), for o < n_pad; values past n are zero.
void InterleaveSplitPairPortable(const float* r0, const float* r1, int64_t n,
                                 int64_t n_pad, int64_t base,
                                 uint16_t* const* out) {
  for (int64_t o = 0; o < n_pad; ++o) {
    for (int e = 0; e < 2; ++e) {
      const float* r = e == 0 ? r0 : r1;
      uint16_t part[3] = {0, 0, 0};
      if (r != nullptr && o < n) Split3(r[o], &part[0], &part[1], &part[2]);
      for (int i = 0; i < 3; ++i) out[i][base + 2 * o + e] = part[i];
    }
  }
}

#if TAPEHOOK_HAVE_AMX_PATH
// The AVX-512 version: a pair's bf16 parts form one 32-bit word
// (row 1's part << 16 | row 0's part), so no shuffles are needed.
TAPEHOOK_AMX void InterleaveSplitPair512(const float* r0, const float* r1,
                                         int64_t n, int64_t n_pad, int64_t base,
                                         uint16_t* const* out) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t o = 0; o < n_pad; o += 16) {
    const __mmask16 m = o + 16 <= n
                            ? __mmask16(0xFFFF)
                            : __mmask16(o >= n ? 0 : (1u << (n - o)) - 1);
    __m512i parts[2][3];
    for (int e = 0; e < 2; ++e) {
      const float* r = e == 0 ? r0 : r1;
      const __m512 t =
          r ? _mm512_maskz_loadu_ps(m, r + o) : _mm512_setzero_ps();
      const __m512i hb = _mm512_and_si512(_mm512_castps_si512(t), top);
      const __m512 rem = _mm512_sub_ps(t, _mm512_castsi512_ps(hb));
      const __m512i mb = _mm512_and_si512(_mm512_castps_si512(rem), top);
      const __m512i lb =
          _mm512_castps_si512(_mm512_sub_ps(rem, _mm512_castsi512_ps(mb)));
      parts[e][0] = hb;
      parts[e][1] = mb;
      parts[e][2] = _mm512_and_si512(lb, top);
    }
    for (int i = 0; i < 3; ++i) {
      const __m512i word =
          _mm512_or_si512(_mm512_srli_epi32(parts[0][i], 16), parts[1][i]);
      _mm512_storeu_si512(out[i] + base + 2 * o, word);
    }
  }
}
#endif

[[maybe_unused]] void InterleaveSplitPair(const float* r0, const float* r1,
                                          int64_t n, int64_t n_pad,
                                          int64_t base, uint16_t* const* out) {
#if TAPEHOOK_HAVE_AMX_PATH
  if (n_pad % 16 == 0) {
    return InterleaveSplitPair512(r0, r1, n, n_pad, base, out);
  }
#endif
  InterleaveSplitPairPortable(r0, r1, n, n_pad, base, out);
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
  return static_cast<float>(EstimatorGrad(e, x, clip));
}

// dst[k] = src[k] * scale[k] [* 1{|w[k]| <= clip} when clip >= 0], k < n
// (n <= 16): one row segment of dW.
void ScaleAndMaskPortable(const float* src, const float* scale, const float* w,
                          float clip, int64_t n, float* dst) {
  for (int64_t k = 0; k < n; ++k) {
    const float v = src[k] * scale[k];
    dst[k] = clip < 0 || std::abs(w[k]) <= clip ? v : 0.0f;
  }
}

#if TAPEHOOK_HAVE_AMX_PATH
TAPEHOOK_AMX void ScaleAndMask512(const float* src, const float* scale,
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

[[maybe_unused]] void ScaleAndMask(const float* src, const float* scale,
                                   const float* w, float clip, int64_t n,
                                   float* dst) {
#if TAPEHOOK_HAVE_AMX_PATH
  return ScaleAndMask512(src, scale, w, clip, n, dst);
#endif
  ScaleAndMaskPortable(src, scale, w, clip, n, dst);
}

// The padded input of a stride-1 conv as a q grid (see the file comment).
struct Grid {
  int64_t batch, hp, wp;
  int64_t top, left;     // zero rows / columns before the data
  int64_t rows, cols;    // data size (in_h, in_w of what is padded)
  int64_t out_h, out_w;  // the output pixels that live on the grid
  int64_t plane() const { return hp * wp; }
  // One past the last output pixel's q.
  int64_t q_end() const {
    return (batch - 1) * plane() + (out_h - 1) * wp + out_w;
  }
  // Data pixel index (n * rows + r) * cols + c of grid row q, or -1 when q
  // is padding.
  int64_t DataPixel(int64_t q) const {
    const int64_t n = q / plane(), rem = q % plane();
    const int64_t r = rem / wp - top, c = rem % wp - left;
    if (n >= batch || r < 0 || r >= rows || c < 0 || c >= cols) return -1;
    return (n * rows + r) * cols + c;
  }
  // f(i, DataPixel(q0 + i)) (data) or f(i, OutPixel(q0 + i)) for i < n,
  // without a division per row.
  template <typename F>
  void Walk(int64_t q0, int64_t n, bool data, F f) const {
    int64_t img = q0 / plane(), row = q0 % plane() / wp, col = q0 % wp;
    for (int64_t i = 0; i < n; ++i) {
      if (data) {
        const int64_t r = row - top, c = col - left;
        f(i, img < batch && r >= 0 && r < rows && c >= 0 && c < cols
                 ? (img * rows + r) * cols + c
                 : -1);
      } else {
        f(i, img < batch && row < out_h && col < out_w
                 ? (img * out_h + row) * out_w + col
                 : -1);
      }
      if (++col == wp) {
        col = 0;
        if (++row == hp) row = 0, ++img;
      }
    }
  }
  // Output pixel index of q, or -1 when q is not an output pixel.
  int64_t OutPixel(int64_t q) const {
    const int64_t n = q / plane(), rem = q % plane();
    const int64_t r = rem / wp, c = rem % wp;
    if (n >= batch || r >= out_h || c >= out_w) return -1;
    return (n * out_h + r) * out_w + c;
  }
};

struct Taps {
  std::vector<int64_t> off;  // grid row offset of each tap
  int64_t max_off = 0;
};

Taps TapOffsets(const ConvShape& s, int64_t wp) {
  Taps t;
  for (int64_t kh = 0; kh < s.k_h; ++kh) {
    for (int64_t kw = 0; kw < s.k_w; ++kw) {
      t.off.push_back(kh * s.dil_h * wp + kw * s.dil_w);
    }
  }
  t.max_off = t.off.back();
  return t;
}

// ---------------------------------------------------------------------------
// Shifted GEMM: C[q, o] = sum_t sum_k A[q + off[t], k] * B_t[k, o].
// A: rows of 3 * kp bf16 (kp % 32 == 0): the hi, mid and lo parts of one
// pixel's k values, each part zero-padded to kp. The parts multiply the same
// B, so B_t is [kp, o] and each B tile is loaded once for three A tiles.
// B: [o_pairs][taps][kp / 32][2 tiles][16 k-pairs][16 cols][2] (AMX's
// pair-interleaved layout), so one o pair's B is contiguous.
//
// A is never materialized: each thread splits the rows it needs into a
// window of a few hundred KiB via fill(r0, r1, dst), so A stays in L2 and
// costs a read of the float input instead of a write and reads of 1.5x its
// size. Units walk all q for a group of o pairs whose B fills about 1 MiB of
// L2, then the next group (which splits the rows again).
struct ShiftedGemm {
  int64_t kp;
  const int64_t* off;
  int64_t taps;
  const uint16_t* b;
  int64_t o_pairs, q_pairs;
  int64_t o_group;  // o pairs per group
  std::function<void(int64_t r0, int64_t r1, uint16_t* dst)> fill;
  int64_t rows, max_off;  // rows [0, rows) of A exist; largest tap offset
  int64_t units() const {
    return (o_pairs + o_group - 1) / o_group * q_pairs * o_group;
  }
};

// q pairs per window refill: about 512 KiB of rows, 4 to 32 pairs.
[[maybe_unused]] int64_t WindowPairs(int64_t ka) {
  return std::max<int64_t>(4, std::min<int64_t>(32, (512 << 10) / (64 * ka)));
}

// Receives one finished 32 x 32 block: c[i * 2 + j] is the 16 x 16 tile of
// rows q0 + 16 i + r, columns o0 + 16 j + col (row-major).
using BlockStore =
    std::function<void(int64_t q0, int64_t o0, const float (*c)[256])>;

#if TAPEHOOK_HAVE_AMX_PATH
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All 8 tiles: 16 rows of 64 bytes (16 fp32 or 32 bf16).
TAPEHOOK_AMX void ConfigureTiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  _tile_loadconfig(&cfg);
}

// Units [u0, u1) of g.units(): unit u is (group, q pair, o pair in group),
// in that order of significance. Tiles 0-3 accumulate the 2 x 2 block, 4-5
// hold A, 6-7 hold B.
TAPEHOOK_AMX void ShiftedGemmUnits(const ShiftedGemm& g, int64_t u0, int64_t u1,
                                   const BlockStore& store) {
  ConfigureTiles();
  alignas(64) float c[4][256];
  const int64_t chunks = g.kp / 32, ka = 3 * g.kp, lda = ka * 2;
  const int64_t win_rows = 32 * WindowPairs(ka) + g.max_off;
  Buffer win(win_rows * ka);
  int64_t win_begin = 0, win_end = 0;  // rows held by the window
  const int64_t per_group = g.q_pairs * g.o_group;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t rem = u % per_group;
    const int64_t op = u / per_group * g.o_group + rem % g.o_group;
    if (op >= g.o_pairs) continue;  // the last group may be short
    const int64_t q0 = rem / g.o_group * 32;
    if (q0 < win_begin || q0 + 32 + g.max_off > win_end) {
      win_begin = q0;
      win_end = std::min(q0 + win_rows, g.rows);
      g.fill(win_begin, win_end, win.p);
    }
    const uint16_t* a = win.p;  // holds row win_begin of A first
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* bt = g.b + op * g.taps * chunks * 1024;
    for (int64_t t = 0; t < g.taps; ++t) {
      const uint16_t* a0 = a + (q0 - win_begin + g.off[t]) * ka;
      for (int64_t kc = 0; kc < chunks; ++kc, bt += 1024) {
        _tile_loadd(6, bt, 64);
        _tile_loadd(7, bt + 512, 64);
        for (int64_t part = 0; part < 3; ++part) {
          const uint16_t* ap = a0 + part * g.kp + kc * 32;
          _tile_loadd(4, ap, lda);
          _tile_loadd(5, ap + 16 * ka, lda);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    store(q0, op * 32, c);
  }
  _tile_release();
}
#endif

// o pairs whose B (taps * kp / 32 tile pairs of 2 KiB each) fill about half
// of a 2 MiB L2.
int64_t OGroup(int64_t o_pairs, int64_t taps, int64_t kp) {
  const int64_t per_pair = taps * (kp / 32) * 2048;
  return std::max<int64_t>(1, std::min(o_pairs, (int64_t{1} << 20) / per_pair));
}

void RunShiftedGemm(const ShiftedGemm& g, const BlockStore& store,
                    const ParallelFor& parallel_for) {
#if TAPEHOOK_HAVE_AMX_PATH
  const int64_t cost = 32 * 32 * g.taps * g.kp * 3 / 8;
  parallel_for(g.units(), cost, [&](int64_t u0, int64_t u1) {
    ShiftedGemmUnits(g, u0, u1, store);
  });
#endif
}

// sign(W) as bf16 in a zero-padded [taps][kp][n_pad] matrix S: the B of a
// shifted GEMM before its pair-interleaving. transposed = false: S[t][c][o]
// = sign W[t][c][o] (the forward); true: S[t][o][c] = sign W[taps-1-t][c][o]
// (backprop-input's flipped, transposed filter), transposed in 8 x 8 blocks.
std::unique_ptr<Buffer> SignMatrix(const float* w, int64_t taps, int64_t C,
                                   int64_t O, bool transposed, int64_t kp,
                                   int64_t n_pad,
                                   const ParallelFor& parallel_for) {
  std::unique_ptr<Buffer> sm(new Buffer(taps * kp * n_pad));
  uint16_t* out = sm->p;
  parallel_for(taps, kp * n_pad, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint16_t* st = out + t * kp * n_pad;
      std::fill(st, st + kp * n_pad, uint16_t{0});
      if (!transposed) {
        for (int64_t c = 0; c < C; ++c) {
          const float* wr = w + (t * C + c) * O;
          uint16_t* row = st + c * n_pad;
          for (int64_t o = 0; o < O; ++o) row[o] = SignBf16(wr[o]);
        }
        continue;
      }
      // Rows of sign W[taps-1-t] (c, o), 8 at a time, transposed into S.
      const int64_t o8 = RoundUp(O, 8);
      std::vector<uint16_t> rows(8 * o8);
      for (int64_t c0 = 0; c0 < C; c0 += 8) {
        std::fill(rows.begin(), rows.end(), uint16_t{0});
        for (int64_t c = c0; c < std::min(C, c0 + 8); ++c) {
          const float* wr = w + ((taps - 1 - t) * C + c) * O;
          for (int64_t o = 0; o < O; ++o)
            rows[(c - c0) * o8 + o] = SignBf16(wr[o]);
        }
        for (int64_t o0 = 0; o0 < o8; o0 += 8) {  // kp >= o8, n_pad >= c0 + 8
          Transpose8x8(&rows[o0], o8, st + o0 * n_pad + c0, n_pad);
        }
      }
    }
  });
  return sm;
}

// Packs S (SignMatrix) in ShiftedGemm's B layout: each B tile row holds
// two consecutive S rows interleaved (AMX's k-pair layout).
void PackShiftedB(const uint16_t* sm, int64_t taps, int64_t kp, int64_t n_pad,
                  uint16_t* b, const ParallelFor& parallel_for) {
  const int64_t chunks = kp / 32, o_pairs = n_pad / 32;
  parallel_for(o_pairs * taps, chunks * 1024, [&](int64_t v0, int64_t v1) {
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t op = v / taps, t = v % taps;
      uint16_t* out = b + v * chunks * 1024;
      for (int64_t kc = 0; kc < chunks; ++kc) {
        for (int64_t j = 0; j < 2; ++j) {
          for (int64_t kpair = 0; kpair < 16; ++kpair, out += 32) {
            const uint16_t* r0 =
                sm + (t * kp + kc * 32 + 2 * kpair) * n_pad + op * 32 + j * 16;
            InterleaveRows16(r0, r0 + n_pad, out);
          }
        }
      }
    }
  });
}

// The B of a shifted GEMM over sign(W) (SignMatrix, then PackShiftedB).
std::unique_ptr<Buffer> SignB(const float* w, int64_t taps, int64_t C,
                              int64_t O, bool transposed, int64_t kp,
                              int64_t n_pad, const ParallelFor& parallel_for) {
  std::unique_ptr<Buffer> b(new Buffer(n_pad * taps * kp));
  const auto sm =
      SignMatrix(w, taps, C, O, transposed, kp, n_pad, parallel_for);
  PackShiftedB(sm->p, taps, kp, n_pad, b->p, parallel_for);
  return b;
}

// Rows [r0, r1) of a shifted GEMM's A over a grid into dst (row r0 first):
// each data pixel's `channels` values (times scale[c] if given) split into
// hi, mid and lo parts of kp values each (zero-padded), zeros for padding.
void FillSplitRange(const Grid& grid, const float* data, const float* scale,
                    int64_t channels, int64_t kp, int64_t r0, int64_t r1,
                    uint16_t* dst) {
  const int64_t ka = 3 * kp;
  grid.Walk(r0, r1 - r0, /*data=*/true, [&](int64_t i, int64_t p) {
    uint16_t* row = dst + i * ka;
    if (p < 0) {
      std::fill(row, row + ka, uint16_t{0});
    } else {
      SplitRow(data + p * channels, scale, channels, kp, row);
    }
  });
}

// ShiftedGemm::fill over a grid of `data` pixels.
std::function<void(int64_t, int64_t, uint16_t*)> SplitFill(const Grid& grid,
                                                           const float* data,
                                                           const float* scale,
                                                           int64_t channels,
                                                           int64_t kp) {
  return [&grid, data, scale, channels, kp](int64_t r0, int64_t r1,
                                            uint16_t* dst) {
    FillSplitRange(grid, data, scale, channels, kp, r0, r1, dst);
  };
}

// alpha (or ones) padded with ones to a multiple of 32.
std::vector<float> PaddedScale(const float* alpha, int64_t n) {
  std::vector<float> out(RoundUp(n, 32), 1.0f);
  if (alpha) std::copy(alpha, alpha + n, out.begin());
  return out;
}

// Writes the output-pixel rows of a finished 32 x 32 block (c as in
// BlockStore) to out[pixel * ld + j] = c * scale[j], j < n, or 0 where
// clip_x is given and !(|clip_x[pixel * ld + j]| <= clip) (the ste_sign
// mask).
#if TAPEHOOK_HAVE_AMX_PATH
TAPEHOOK_AMX void StoreRows(const Grid& grid, int64_t q0, const float (*c)[256],
                            const float* scale, int64_t n, float* out,
                            int64_t ld, const float* clip_x = nullptr,
                            float clip = 0) {
  const __mmask16 kl = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __mmask16 kr = n >= 32   ? __mmask16(0xFFFF)
                       : n <= 16 ? __mmask16(0)
                                 : __mmask16((1u << (n - 16)) - 1);
  const __m512 sl = _mm512_maskz_loadu_ps(kl, scale);
  const __m512 sr = _mm512_maskz_loadu_ps(kr, scale + 16);
  const __m512 lim = _mm512_set1_ps(clip);
  int64_t pixel[32];
  grid.Walk(q0, 32, /*data=*/false,
            [&](int64_t i, int64_t p) { pixel[i] = p; });
  for (int64_t i = 0; i < 32; ++i) {
    if (pixel[i] < 0) continue;
    const int64_t at = pixel[i] * ld;
    __mmask16 ml = kl, mr = kr;
    if (clip_x != nullptr) {  // keep lanes with |x| <= clip (NaN: dropped)
      const __m512 xl = _mm512_maskz_loadu_ps(kl, clip_x + at);
      const __m512 xr = _mm512_maskz_loadu_ps(kr, clip_x + at + 16);
      ml = _mm512_mask_cmp_ps_mask(kl, _mm512_abs_ps(xl), lim, _CMP_LE_OQ);
      mr = _mm512_mask_cmp_ps_mask(kr, _mm512_abs_ps(xr), lim, _CMP_LE_OQ);
    }
    float* dst = out + at;
    const float* left = c[(i / 16) * 2] + (i % 16) * 16;
    const float* right = c[(i / 16) * 2 + 1] + (i % 16) * 16;
    _mm512_mask_storeu_ps(dst, kl,
                          _mm512_maskz_mul_ps(ml, _mm512_load_ps(left), sl));
    _mm512_mask_storeu_ps(dst + 16, kr,
                          _mm512_maskz_mul_ps(mr, _mm512_load_ps(right), sr));
  }
}
#else
void StoreRows(const Grid& grid, int64_t q0, const float (*c)[256],
               const float* scale, int64_t n, float* out, int64_t ld,
               const float* clip_x = nullptr, float clip = 0) {
  for (int64_t r = 0; r < 32; ++r) {
    const int64_t p = grid.OutPixel(q0 + r);
    if (p < 0) continue;
    float* dst = out + p * ld;
    const float* xr = clip_x ? clip_x + p * ld : nullptr;
    const float* left = c[(r / 16) * 2] + (r % 16) * 16;
    const float* right = c[(r / 16) * 2 + 1] + (r % 16) * 16;
    if (n == 32) {
      for (int j = 0; j < 16; ++j) dst[j] = left[j] * scale[j];
      for (int j = 0; j < 16; ++j) dst[16 + j] = right[j] * scale[16 + j];
    } else {
      for (int64_t j = 0; j < std::min<int64_t>(n, 16); ++j) {
        dst[j] = left[j] * scale[j];
      }
      for (int64_t j = 16; j < n; ++j) dst[j] = right[j - 16] * scale[j];
    }
    for (int64_t j = 0; xr != nullptr && j < n; ++j) {
      if (!(std::abs(xr[j]) <= clip)) dst[j] = 0.0f;
    }
  }
}

#endif

// ---------------------------------------------------------------------------
// Backprop filter: dW_t[c, o] = sum_q X[c, q + off[t]] * D[q, o], X being
// x_hat on the grid transposed (rows = channels), D being dy on the grid
// in pair-interleaved rows: [q / 2][o_pad][2].
struct FilterGemm {
  const uint16_t* const* x_parts;  // [c_pad][qa] each
  int64_t qa;
  const uint16_t* const* d_parts;  // [q_len / 2][o_pad][2] each
  int64_t o_pad, q_len, kblock;
  const int64_t* off;
  int64_t taps, c_pairs, o_pairs;
  int64_t c_group;  // c pairs per item
  // Products kept: x part x_of[i] times dy part d_of[i], grouped by x part.
  const int* x_of;
  const int* d_of;
  int n_pairs;
  // Partial sums, [k block][tap][c pair][o pair][4][256] (fp32); with a
  // single k block, finish(unit, sums) takes each unit's sums instead.
  float* partial;
  std::function<void(int64_t unit, const float* sums)> finish;
};

#if TAPEHOOK_HAVE_AMX_PATH
// Items [i0, i1): item i is (k block, o pair, group of c pairs), in that
// order of significance. An item reads one block of columns of x (its
// channels) and dy (32 channels), about 1 MiB that stays in L2 while it runs
// every tap and c pair of the group over it, so items can be sharded any way
// without re-reading memory.
TAPEHOOK_AMX void FilterGemmItems(const FilterGemm& g, int64_t i0, int64_t i1) {
  ConfigureTiles();
  const int64_t lda = g.qa * 2, ldb = g.o_pad * 4;
  const int64_t units = g.taps * g.c_pairs * g.o_pairs;
  alignas(64) float sums[1024];
  const int64_t c_groups = (g.c_pairs + g.c_group - 1) / g.c_group;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t cg = item % c_groups, rest = item / c_groups;
    const int64_t kb = rest / g.o_pairs, op = rest % g.o_pairs;
    const int64_t k0 = kb * g.kblock, k1 = std::min(g.q_len, k0 + g.kblock);
    const int64_t o0 = op * 32;
    const int64_t cp1 = std::min(g.c_pairs, (cg + 1) * g.c_group);
    for (int64_t t = 0; t < g.taps; ++t) {
      for (int64_t cp = cg * g.c_group; cp < cp1; ++cp) {
        const int64_t c0 = cp * 32;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t q0 = k0; q0 < k1; q0 += 32) {
          int last_x = -1;
          for (int i = 0; i < g.n_pairs; ++i) {
            if (g.x_of[i] != last_x) {
              last_x = g.x_of[i];
              const uint16_t* xa =
                  g.x_parts[last_x] + c0 * g.qa + q0 + g.off[t];
              _tile_loadd(4, xa, lda);
              _tile_loadd(5, xa + 16 * g.qa, lda);
            }
            const uint16_t* db =
                g.d_parts[g.d_of[i]] + q0 / 2 * g.o_pad * 2 + o0 * 2;
            _tile_loadd(6, db, ldb);
            _tile_loadd(7, db + 32, ldb);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        const int64_t unit = (t * g.c_pairs + cp) * g.o_pairs + op;
        float* out = g.finish ? sums : g.partial + (kb * units + unit) * 1024;
        _tile_stored(0, out, 64);
        _tile_stored(1, out + 256, 64);
        _tile_stored(2, out + 512, 64);
        _tile_stored(3, out + 768, 64);
        if (g.finish) g.finish(unit, sums);
      }
    }
  }
  _tile_release();
}
#endif

// A q grid for data of rows x cols pixels padded by (top, left) and read
// by a stride-1 conv with taps spanning (eh, ew) to give out_h x out_w
// outputs: tall and wide enough for the data and for every tap of every
// output.
Grid PaddedGrid(int64_t batch, int64_t top, int64_t left, int64_t rows,
                int64_t cols, int64_t out_h, int64_t out_w, int64_t eh,
                int64_t ew) {
  Grid g;
  g.batch = batch;
  g.top = top;
  g.left = left;
  g.rows = rows;
  g.cols = cols;
  g.out_h = out_h;
  g.out_w = out_w;
  g.hp = std::max(top + rows, out_h + eh);
  g.wp = std::max(left + cols, out_w + ew);
  return g;
}

// The grid of a stride-1 forward conv's padded input.
Grid InputGrid(const ConvShape& s) {
  return PaddedGrid(s.batch, s.pad_top, s.pad_left, s.in_h, s.in_w, s.out_h,
                    s.out_w, (s.k_h - 1) * s.dil_h, (s.k_w - 1) * s.dil_w);
}

bool NonEmpty(const ConvShape& s) {
  return s.batch > 0 && s.in_h > 0 && s.in_w > 0 && s.in_c > 0 && s.out_c > 0 &&
         s.out_h > 0 && s.out_w > 0 && s.k_h > 0 && s.k_w > 0;
}

}  // namespace

bool Usable() {
  // TAPEHOOK_NO_AVX2 asks for the portable kernels: no AMX either.
  for (const char* name : {"TAPEHOOK_NO_AMX", "TAPEHOOK_NO_AVX2"}) {
    const char* off = std::getenv(name);
    if (off != nullptr && off[0] != '\0' && off[0] != '0') return false;
  }
  return CpuAndOsReady();
}

bool SupportsForward(const ConvShape& s) {
  return TAPEHOOK_HAVE_AMX_PATH && NonEmpty(s) && s.stride_h == 1 &&
         s.stride_w == 1;
}

bool SupportsBackpropInput(const ConvShape& s) {
  return SupportsForward(s) && s.pad_top <= (s.k_h - 1) * s.dil_h &&
         s.pad_left <= (s.k_w - 1) * s.dil_w;
}

bool SupportsBackpropFilter(const ConvShape& s) { return SupportsForward(s); }

struct ForwardFilter {
  int64_t k_h = 0, k_w = 0, in_c = 0, out_c = 0;
  std::unique_ptr<Buffer> b;  // sign(W) as the shifted GEMM's B
  std::vector<float> scale;   // alpha (or ones), PaddedScale
};

std::shared_ptr<const ForwardFilter> PackForwardFilter(
    const ConvShape& s, const float* w, const float* alpha,
    const ParallelFor& parallel_for) {
  if (!SupportsForward(s) || !Usable()) return nullptr;
  const int64_t C = s.in_c, O = s.out_c, taps = s.k_h * s.k_w;
  auto f = std::make_shared<ForwardFilter>();
  f->k_h = s.k_h, f->k_w = s.k_w, f->in_c = C, f->out_c = O;
  f->b = SignB(w, taps, C, O, /*transposed=*/false, RoundUp(C, 32),
               (O + 31) / 32 * 32, parallel_for);
  f->scale = PaddedScale(alpha, O);
  return f;
}

bool ForwardFilterFits(const ForwardFilter& f, const ConvShape& s) {
  return f.k_h == s.k_h && f.k_w == s.k_w && f.in_c == s.in_c &&
         f.out_c == s.out_c;
}

bool ForwardWith(const ConvShape& s, const float* x, const ForwardFilter& f,
                 float* y, const ParallelFor& parallel_for) {
  if (!SupportsForward(s) || !Usable() || !ForwardFilterFits(f, s)) {
    return false;
  }
  const int64_t C = s.in_c, O = s.out_c, taps = s.k_h * s.k_w;
  const Grid grid = InputGrid(s);
  const Taps tp = TapOffsets(s, grid.wp);
  const int64_t kp = RoundUp(C, 32);
  const int64_t q_pairs = (grid.q_end() + 31) / 32;
  const int64_t rows = q_pairs * 32 + tp.max_off;
  const int64_t o_pairs = (O + 31) / 32;
  const ShiftedGemm g{kp,
                      tp.off.data(),
                      taps,
                      f.b->p,
                      o_pairs,
                      q_pairs,
                      OGroup(o_pairs, taps, kp),
                      SplitFill(grid, x, nullptr, C, kp),
                      rows,
                      tp.max_off};
  RunShiftedGemm(
      g,
      [&](int64_t q0, int64_t o0, const float (*c)[256]) {
        StoreRows(grid, q0, c, f.scale.data() + o0,
                  std::min<int64_t>(32, O - o0), y + o0, O);
      },
      parallel_for);
  return true;
}

bool Forward(const ConvShape& s, const float* x, const float* w,
             const float* alpha, float* y, const ParallelFor& parallel_for) {
  const std::shared_ptr<const ForwardFilter> f =
      PackForwardFilter(s, w, alpha, parallel_for);
  return f != nullptr && ForwardWith(s, x, *f, y, parallel_for);
}

namespace {

// The input comes either as floats (x) or as packed sign / mask bits
// (packed, pack_input.h, with the ste_sign estimator); exactly one is set.
bool BackpropInputImpl(const ConvShape& s, const float* x,
                       const uint8_t* packed, const float* w, const float* dy,
                       Estimator act_est, double clip, const float* alpha,
                       float* dx, const ParallelFor& parallel_for) {
  if (!SupportsBackpropInput(s) || !Usable()) return false;
  const int64_t C = s.in_c, O = s.out_c, taps = s.k_h * s.k_w;
  const int64_t eh = (s.k_h - 1) * s.dil_h, ew = (s.k_w - 1) * s.dil_w;
  // dx = conv2d(dy padded by (eh - pad_top, ew - pad_left), flipped W^T).
  const Grid grid = PaddedGrid(s.batch, eh - s.pad_top, ew - s.pad_left,
                               s.out_h, s.out_w, s.in_h, s.in_w, eh, ew);
  const Taps tp = TapOffsets(s, grid.wp);
  const int64_t kp = RoundUp(O, 32);
  const int64_t q_pairs = (grid.q_end() + 31) / 32;
  const int64_t rows = q_pairs * 32 + tp.max_off;
  const int64_t c_pairs = (C + 31) / 32;

  const std::vector<float> scale = PaddedScale(alpha, O);

  const auto b = SignB(w, taps, C, O, /*transposed=*/true, kp, c_pairs * 32,
                       parallel_for);

  const std::vector<float> ones(32, 1.0f);
  const ShiftedGemm g{
      kp,
      tp.off.data(),
      taps,
      b->p,
      c_pairs,
      q_pairs,
      OGroup(c_pairs, taps, kp),
      SplitFill(grid, dy, alpha ? scale.data() : nullptr, O, kp),
      rows,
      tp.max_off};
  RunShiftedGemm(
      g,
      [&](int64_t q0, int64_t c0, const float (*acc)[256]) {
        const int64_t c_n = std::min<int64_t>(32, C - c0);
        if (packed != nullptr) {  // store and mask in one pass
          grid.Walk(q0, 32, /*data=*/false, [&](int64_t r, int64_t p) {
            if (p < 0) return;
            StoreMaskedRow(acc[(r / 16) * 2] + (r % 16) * 16,
                           acc[(r / 16) * 2 + 1] + (r % 16) * 16, c_n,
                           packed + p * PackedBytes(C) + c0 / 4,
                           dx + p * C + c0);
          });
          return;
        }
        if (act_est == Estimator::kNone || act_est == Estimator::kSteSign) {
          StoreRows(grid, q0, acc, ones.data(), c_n, dx + c0, C,
                    act_est == Estimator::kSteSign ? x + c0 : nullptr,
                    static_cast<float>(clip));
          return;
        }
        StoreRows(grid, q0, acc, ones.data(), c_n, dx + c0, C);
        for (int64_t r = 0; r < 32; ++r) {
          const int64_t p = grid.OutPixel(q0 + r);
          if (p < 0) continue;
          float* out = dx + p * C + c0;
          const float* xr = x + p * C + c0;
          for (int64_t j = 0; j < c_n; ++j) {
            out[j] *= ActGrad(act_est, xr[j], clip);
          }
        }
      },
      parallel_for);
  return true;
}

bool BackpropFilterImpl(const ConvShape& s, const float* x,
                        const uint8_t* packed, const float* w, const float* dy,
                        Estimator act_est, Estimator w_est, double clip,
                        const float* alpha, float* dw,
                        const ParallelFor& parallel_for) {
  if (!SupportsBackpropFilter(s) || !Usable()) return false;
#if TAPEHOOK_HAVE_AMX_PATH
  const int64_t C = s.in_c, O = s.out_c, taps = s.k_h * s.k_w;
  const bool binary = act_est != Estimator::kNone;
  const Grid grid = InputGrid(s);
  const Taps tp = TapOffsets(s, grid.wp);
  const int64_t q_len = RoundUp(grid.q_end(), 32);
  const int64_t qa = RoundUp(q_len + tp.max_off, 32);
  const int64_t c_pad = RoundUp(C, 32), o_pad = RoundUp(O, 32);
  const int x_n = binary ? 1 : 3;

  // x_hat transposed onto the grid: x_parts[i][c][q].
  std::vector<std::unique_ptr<Buffer>> xb;
  std::vector<const uint16_t*> x_parts;
  for (int i = 0; i < x_n; ++i) {
    xb.emplace_back(new Buffer(c_pad * qa));
    x_parts.push_back(xb.back()->p);
  }
  // Blocks of 128 grid rows by 32 channels: split row-major into tmp (L1),
  // then write each channel's run of 128 values.
  constexpr int64_t kQBlock = 128;
  const int64_t q_blocks = (qa + kQBlock - 1) / kQBlock;
  parallel_for(
      q_blocks * (c_pad / 32), kQBlock * 32 * 8, [&](int64_t v0, int64_t v1) {
        std::vector<uint16_t> tmp(kQBlock * 96);
        for (int64_t v = v0; v < v1; ++v) {
          const int64_t q0 = v / (c_pad / 32) * kQBlock,
                        c0 = v % (c_pad / 32) * 32;
          const int64_t nq = std::min(kQBlock, qa - q0);
          const int64_t nc =
              std::max<int64_t>(0, std::min<int64_t>(32, C - c0));
          grid.Walk(q0, nq, /*data=*/true, [&](int64_t i, int64_t p) {
            uint16_t* row = &tmp[i * 96];
            if (p < 0 || nc == 0) {
              std::fill(row, row + 96, uint16_t{0});
            } else if (binary) {
              if (packed != nullptr) {
                SignRowFromBits(packed + p * PackedBytes(C), c0, nc, row);
              } else {
                SignRow(x + p * C + c0, nc, row);
              }
            } else {
              SplitRow(x + p * C + c0, nullptr, nc, 32, row);
            }
          });
          for (int i = 0; i < x_n; ++i) {  // nq is a multiple of 32
            for (int64_t c8 = 0; c8 < 32; c8 += 8) {
              for (int64_t q8 = 0; q8 < nq; q8 += 8) {
                Transpose8x8(&tmp[q8 * 96 + i * 32 + c8], 96,
                             xb[i]->p + (c0 + c8) * qa + q0 + q8, qa);
              }
            }
          }
        }
      });

  // dy on the grid, split, pair-interleaved: d_parts[i][q / 2][o][q % 2].
  std::vector<std::unique_ptr<Buffer>> db;
  std::vector<const uint16_t*> d_parts;
  for (int i = 0; i < 3; ++i) {
    db.emplace_back(new Buffer(q_len * o_pad));
    d_parts.push_back(db.back()->p);
  }
  uint16_t* d_out[3] = {db[0]->p, db[1]->p, db[2]->p};
  parallel_for(q_len / 2, 2 * o_pad, [&](int64_t p0, int64_t p1) {
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t a = grid.OutPixel(2 * pr), b = grid.OutPixel(2 * pr + 1);
      InterleaveSplitPair(a < 0 ? nullptr : dy + a * O,
                          b < 0 ? nullptr : dy + b * O, O, o_pad,
                          pr * o_pad * 2, d_out);
    }
  });

  static const int kBinX[] = {0, 0, 0}, kBinD[] = {0, 1, 2};
  static const int kFloatX[] = {0, 0, 0, 1, 1, 2},
                   kFloatD[] = {0, 1, 2, 0, 1, 0};
  const int64_t c_pairs = c_pad / 32, o_pairs = o_pad / 32;
  const int64_t units = taps * c_pairs * o_pairs;
  // An item's columns of x and dy fill about 1 MiB of L2 (more thrashes it:
  // 7x7x512 ran 2.3x slower with 1.6 MiB). All of K in one block lets each
  // unit's sums go straight to dW, with no partial sums through memory; it
  // may take halving the channels per item (each half then re-reads dy).
  constexpr int64_t kItemBytes = int64_t{1} << 20;
  auto bytes_per_q = [&](int64_t c_group) {
    return (x_n * 32 * c_group + 3 * 32) * 2;
  };
  int64_t c_group = c_pairs;
  if (q_len * bytes_per_q(c_group) > kItemBytes &&
      q_len * bytes_per_q((c_pairs + 1) / 2) <= kItemBytes) {
    c_group = (c_pairs + 1) / 2;
  }
  const int64_t kblock = std::min(
      q_len,
      std::max<int64_t>(32, kItemBytes / bytes_per_q(c_group) / 32 * 32));
  const int64_t k_blocks = (q_len + kblock - 1) / kblock;
  const int64_t c_groups = (c_pairs + c_group - 1) / c_group;
  const std::vector<float> scale = PaddedScale(alpha, O);
  const float clip_f = static_cast<float>(clip);
  // dw of unit u from its summed tiles a (4 x [16][16], as FilterGemm).
  auto finish = [&](int64_t u, const float* a) {
    const int64_t t = u / (c_pairs * o_pairs), rem = u % (c_pairs * o_pairs);
    const int64_t c0 = rem / o_pairs * 32, o0 = rem % o_pairs * 32;
    for (int64_t r = 0; r < 32 && c0 + r < C; ++r) {
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t o = o0 + half * 16;
        const int64_t n = std::min<int64_t>(16, O - o);
        if (n <= 0) break;
        const float* src = a + ((r / 16) * 2 + half) * 256 + (r % 16) * 16;
        const int64_t i = (t * C + c0 + r) * O + o;
        if (w_est == Estimator::kNone || w_est == Estimator::kSteSign) {
          ScaleAndMask(src, scale.data() + o, w + i,
                       w_est == Estimator::kSteSign ? clip_f : -1.0f, n,
                       dw + i);
          continue;
        }
        for (int64_t k = 0; k < n; ++k) {
          dw[i + k] = src[k] * scale[o + k] * ActGrad(w_est, w[i + k], clip);
        }
      }
    }
  };
  std::unique_ptr<Buffer> partial_buf(
      k_blocks > 1 ? new Buffer(k_blocks * units * 1024 * 2) : nullptr);
  FilterGemm g{x_parts.data(),
               qa,
               d_parts.data(),
               o_pad,
               q_len,
               kblock,
               tp.off.data(),
               taps,
               c_pairs,
               o_pairs,
               c_group,
               binary ? kBinX : kFloatX,
               binary ? kBinD : kFloatD,
               binary ? 3 : 6,
               partial_buf ? reinterpret_cast<float*>(partial_buf->p) : nullptr,
               nullptr};
  if (k_blocks == 1) g.finish = finish;
  parallel_for(k_blocks * o_pairs * c_groups,
               kblock * 32 * 32 * c_group * taps * g.n_pairs / 8,
               [&](int64_t i0, int64_t i1) { FilterGemmItems(g, i0, i1); });

  if (k_blocks > 1) {  // sum the k blocks' partial sums, then finish
    parallel_for(units, 1024, [&](int64_t u0, int64_t u1) {
      alignas(64) float a[1024];
      for (int64_t u = u0; u < u1; ++u) {
        std::copy_n(g.partial + u * 1024, 1024, a);
        for (int64_t kb = 1; kb < k_blocks; ++kb) {
          const float* src = g.partial + (kb * units + u) * 1024;
          for (int i = 0; i < 1024; ++i) a[i] += src[i];
        }
        finish(u, a);
      }
    });
  }
  return true;
#else
  return false;
#endif
}

}  // namespace

bool BackpropInput(const ConvShape& s, const float* x, const float* w,
                   const float* dy, Estimator act_est, double clip,
                   const float* alpha, float* dx,
                   const ParallelFor& parallel_for) {
  return BackpropInputImpl(s, x, nullptr, w, dy, act_est, clip, alpha, dx,
                           parallel_for);
}

bool BackpropFilter(const ConvShape& s, const float* x, const float* w,
                    const float* dy, Estimator act_est, Estimator w_est,
                    double clip, const float* alpha, float* dw,
                    const ParallelFor& parallel_for) {
  return BackpropFilterImpl(s, x, nullptr, w, dy, act_est, w_est, clip, alpha,
                            dw, parallel_for);
}

bool BackpropInputPacked(const ConvShape& s, const uint8_t* packed,
                         const float* w, const float* dy, const float* alpha,
                         float* dx, const ParallelFor& parallel_for) {
  return BackpropInputImpl(s, nullptr, packed, w, dy, Estimator::kSteSign, 1.0,
                           alpha, dx, parallel_for);
}

bool BackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                          const float* w, const float* dy, Estimator w_est,
                          double clip, const float* alpha, float* dw,
                          const ParallelFor& parallel_for) {
  return BackpropFilterImpl(s, nullptr, packed, w, dy, Estimator::kSteSign,
                            w_est, clip, alpha, dw, parallel_for);
}

}  // namespace amx
}  // namespace tapehook
