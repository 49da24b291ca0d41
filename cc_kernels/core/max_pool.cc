#include "max_pool.h"

#include <algorithm>
#include <limits>

#include "cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TAPEHOOK_HAVE_POOL_SIMD 1
#else
#define TAPEHOOK_HAVE_POOL_SIMD 0
#endif

namespace tapehook {

namespace {

// One output element's channels: the first tap, then every later one.
void TakeTap(const float* __restrict tap, int32_t base, int64_t c,
             float* __restrict best, int32_t* __restrict where) {
  for (int64_t k = 0; k < c; ++k) {
    best[k] = tap[k];
    where[k] = base + static_cast<int32_t>(k);
  }
}

// Branch-free (a later tap wins only where strictly greater), so the channel
// loop vectorizes.
void MaxTap(const float* __restrict tap, int32_t base, int64_t c,
            float* __restrict best, int32_t* __restrict where) {
  for (int64_t k = 0; k < c; ++k) {
    const bool take = best[k] < tap[k];
    best[k] = take ? tap[k] : best[k];
    where[k] = take ? base + static_cast<int32_t>(k) : where[k];
  }
}

#if TAPEHOOK_HAVE_POOL_SIMD
__attribute__((target("avx512f"))) void MaxTap512(const float* __restrict tap,
                                                  int32_t base, int64_t c,
                                                  float* __restrict best,
                                                  int32_t* __restrict where) {
  const __m512i lanes =
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t k = 0;
  for (; k + 16 <= c; k += 16) {
    const __m512 b = _mm512_loadu_ps(best + k), t = _mm512_loadu_ps(tap + k);
    const __mmask16 take = _mm512_cmp_ps_mask(b, t, _CMP_LT_OQ);
    _mm512_storeu_ps(best + k, _mm512_mask_mov_ps(b, take, t));
    const __m512i index = _mm512_add_epi32(
        _mm512_set1_epi32(base + static_cast<int32_t>(k)), lanes);
    _mm512_mask_storeu_epi32(where + k, take, index);
  }
  MaxTap(tap + k, base + static_cast<int32_t>(k), c - k, best + k, where + k);
}

__attribute__((target("avx2"))) void MaxTap256(const float* __restrict tap,
                                               int32_t base, int64_t c,
                                               float* __restrict best,
                                               int32_t* __restrict where) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t k = 0;
  for (; k + 8 <= c; k += 8) {
    const __m256 b = _mm256_loadu_ps(best + k), t = _mm256_loadu_ps(tap + k);
    const __m256 take = _mm256_cmp_ps(b, t, _CMP_LT_OQ);
    _mm256_storeu_ps(best + k, _mm256_blendv_ps(b, t, take));
    const __m256i index = _mm256_add_epi32(
        _mm256_set1_epi32(base + static_cast<int32_t>(k)), lanes);
    const __m256i old =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(where + k));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(where + k),
        _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(old), _mm256_castsi256_ps(index), take)));
  }
  MaxTap(tap + k, base + static_cast<int32_t>(k), c - k, best + k, where + k);
}
#endif

}  // namespace

void MaxPoolArgmax(const ConvShape& s, const float* x, float* y,
                   int32_t* argmax, const ParallelFor& parallel_for) {
  const int64_t c = s.in_c, row = s.in_w * c;
  const int64_t taps = s.k_h * s.k_w;
  auto* later = &MaxTap;
#if TAPEHOOK_HAVE_POOL_SIMD
  if (cpu::UnpackInput512()) {
    later = &MaxTap512;
  } else if (cpu::Avx2()) {
    later = &MaxTap256;
  }
#endif
  // One unit: one output row of one image.
  parallel_for(
      s.batch * s.out_h, s.out_w * taps * c, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
          const int64_t n = u / s.out_h, oh = u % s.out_h;
          const float* image = x + n * s.in_h * row;
          const int64_t h0 = oh * s.stride_h - s.pad_top;
          const int64_t h_lo = std::max<int64_t>(h0, 0);
          const int64_t h_hi = std::min<int64_t>(h0 + s.k_h, s.in_h);
          for (int64_t ow = 0; ow < s.out_w; ++ow) {
            float* best = y + (u * s.out_w + ow) * c;
            int32_t* where = argmax + (u * s.out_w + ow) * c;
            const int64_t w0 = ow * s.stride_w - s.pad_left;
            const int64_t w_lo = std::max<int64_t>(w0, 0);
            const int64_t w_hi = std::min<int64_t>(w0 + s.k_w, s.in_w);
            bool first = true;
            for (int64_t ih = h_lo; ih < h_hi; ++ih) {
              for (int64_t iw = w_lo; iw < w_hi; ++iw) {
                const int64_t base = ih * row + iw * c;
                (first ? TakeTap : later)(
                    image + base, static_cast<int32_t>(base), c, best, where);
                first = false;
              }
            }
            if (first) {  // no tap in the image (not with TF's geometry)
              std::fill(best, best + c, std::numeric_limits<float>::lowest());
              std::fill(where, where + c, -1);
            }
          }
        }
      });
}

}  // namespace tapehook
