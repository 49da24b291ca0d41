#include "max_pool.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TAPEHOOK_HAVE_POOL_SIMD 1
#else
#define TAPEHOOK_HAVE_POOL_SIMD 0
#endif

namespace tapehook {

namespace {

// One output element's channels: the first tap, then every later one. A
// channel k's index is base + step * k: the flat input index (step 1) or the
// tap number (step 0).
void TakeTap(const float* __restrict tap, int32_t base, int32_t step, int64_t c,
             float* __restrict best, int32_t* __restrict where) {
  for (int64_t k = 0; k < c; ++k) {
    best[k] = tap[k];
    where[k] = base + step * static_cast<int32_t>(k);
  }
}

// Branch-free (a later tap wins only where strictly greater), so the channel
// loop vectorizes.
void MaxTap(const float* __restrict tap, int32_t base, int32_t step, int64_t c,
            float* __restrict best, int32_t* __restrict where) {
  for (int64_t k = 0; k < c; ++k) {
    const bool take = best[k] < tap[k];
    best[k] = take ? tap[k] : best[k];
    where[k] = take ? base + step * static_cast<int32_t>(k) : where[k];
  }
}

#if TAPEHOOK_HAVE_POOL_SIMD
__attribute__((target("avx512f"))) void MaxTap512(const float* __restrict tap,
                                                  int32_t base, int32_t step,
                                                  int64_t c,
                                                  float* __restrict best,
                                                  int32_t* __restrict where) {
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(step));
  int64_t k = 0;
  for (; k + 16 <= c; k += 16) {
    const __m512 b = _mm512_loadu_ps(best + k), t = _mm512_loadu_ps(tap + k);
    const __mmask16 take = _mm512_cmp_ps_mask(b, t, _CMP_LT_OQ);
    _mm512_storeu_ps(best + k, _mm512_mask_mov_ps(b, take, t));
    const __m512i index = _mm512_add_epi32(
        _mm512_set1_epi32(base + step * static_cast<int32_t>(k)), lanes);
    _mm512_mask_storeu_epi32(where + k, take, index);
  }
  MaxTap(tap + k, base + step * static_cast<int32_t>(k), step, c - k, best + k,
         where + k);
}

__attribute__((target("avx2"))) void MaxTap256(const float* __restrict tap,
                                               int32_t base, int32_t step,
                                               int64_t c,
                                               float* __restrict best,
                                               int32_t* __restrict where) {
  const __m256i lanes = _mm256_mullo_epi32(
      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(step));
  int64_t k = 0;
  for (; k + 8 <= c; k += 8) {
    const __m256 b = _mm256_loadu_ps(best + k), t = _mm256_loadu_ps(tap + k);
    const __m256 take = _mm256_cmp_ps(b, t, _CMP_LT_OQ);
    _mm256_storeu_ps(best + k, _mm256_blendv_ps(b, t, take));
    const __m256i index = _mm256_add_epi32(
        _mm256_set1_epi32(base + step * static_cast<int32_t>(k)), lanes);
    const __m256i old =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(where + k));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(where + k),
        _mm256_castps_si256(_mm256_blendv_ps(
            _mm256_castsi256_ps(old), _mm256_castsi256_ps(index), take)));
  }
  MaxTap(tap + k, base + step * static_cast<int32_t>(k), step, c - k, best + k,
         where + k);
}
#endif

using TapFn = void (*)(const float*, int32_t, int32_t, int64_t, float*,
                       int32_t*);

TapFn LaterTap() {
#if TAPEHOOK_HAVE_POOL_SIMD
  if (cpu::UnpackInput512()) return &MaxTap512;
  if (cpu::Avx2()) return &MaxTap256;
#endif
  return &MaxTap;
}

// The one window loop of both pools: per output element, its window's
// in-image taps in row-major order; index(ih, iw, h0, w0) is a tap's base
// index, `step` its channels' (see TakeTap). where_of(u) gives a unit's
// index row (out_w * c int32s) and done(u, where) runs after the unit.
template <typename Index, typename WhereOf, typename Done>
void PoolUnits(const ConvShape& s, const float* x, float* y, int32_t step,
               Index index, WhereOf where_of, Done done,
               const ParallelFor& parallel_for) {
  const int64_t c = s.in_c, row = s.in_w * c;
  const int64_t taps = s.k_h * s.k_w;
  const TapFn later = LaterTap();
  // One unit: one output row of one image.
  parallel_for(
      s.batch * s.out_h, s.out_w * taps * c, [&](int64_t begin, int64_t end) {
        for (int64_t u = begin; u < end; ++u) {
          const int64_t n = u / s.out_h, oh = u % s.out_h;
          const float* image = x + n * s.in_h * row;
          const int64_t h0 = oh * s.stride_h - s.pad_top;
          const int64_t h_lo = std::max<int64_t>(h0, 0);
          const int64_t h_hi = std::min<int64_t>(h0 + s.k_h, s.in_h);
          int32_t* where_row = where_of(u);
          for (int64_t ow = 0; ow < s.out_w; ++ow) {
            float* best = y + (u * s.out_w + ow) * c;
            int32_t* where = where_row + ow * c;
            const int64_t w0 = ow * s.stride_w - s.pad_left;
            const int64_t w_lo = std::max<int64_t>(w0, 0);
            const int64_t w_hi = std::min<int64_t>(w0 + s.k_w, s.in_w);
            bool first = true;
            for (int64_t ih = h_lo; ih < h_hi; ++ih) {
              for (int64_t iw = w_lo; iw < w_hi; ++iw) {
                const int32_t base = index(ih, iw, h0, w0);
                if (first) {
                  TakeTap(image + ih * row + iw * c, base, step, c, best,
                          where);
                } else {
                  later(image + ih * row + iw * c, base, step, c, best, where);
                }
                first = false;
              }
            }
            if (first) {  // no tap in the image (not with TF's geometry)
              std::fill(best, best + c, std::numeric_limits<float>::lowest());
              std::fill(where, where + c, -1);
            }
          }
          done(u, where_row);
        }
      });
}

// Calls visit(out_index, in_index, dead) for each output element with a
// tap (not kNoTap), in output order within an image; images in parallel,
// each after begin_image(n) (by the thread that then visits it). False (and
// nothing visited past it) where a tap is not a window's in-image position:
// taps not made by MaxPoolTaps on this geometry.
template <typename Visit, typename BeginImage>
bool ForEachTap(const ConvShape& s, const int8_t* taps,
                const ParallelFor& parallel_for, Visit visit,
                BeginImage begin_image) {
  const int64_t c = s.in_c, row = s.in_w * c;
  const int64_t per_image = s.out_h * s.out_w * c;
  // A tap's row and column in its window.
  const int64_t taps_per_window = s.k_h * s.k_w;
  std::vector<int64_t> tap_h(taps_per_window), tap_w(taps_per_window);
  for (int64_t t = 0; t < taps_per_window; ++t) {
    tap_h[t] = t / s.k_w;
    tap_w[t] = t % s.k_w;
  }
  std::atomic<bool> valid{true};
  parallel_for(s.batch, per_image * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end && valid.load(std::memory_order_relaxed);
         ++n) {
      const int64_t in0 = n * s.in_h * row;
      begin_image(n);
      for (int64_t oh = 0; oh < s.out_h; ++oh) {
        const int64_t h0 = oh * s.stride_h - s.pad_top;
        for (int64_t ow = 0; ow < s.out_w; ++ow) {
          const int64_t w0 = ow * s.stride_w - s.pad_left;
          const int64_t o = ((n * s.out_h + oh) * s.out_w + ow) * c;
          for (int64_t k = 0; k < c; ++k) {
            const int t = taps[o + k];
            if (t == kNoTap) continue;
            const int tap = t < 0 ? ~t : t;
            if (tap >= taps_per_window) {
              valid = false;
              return;
            }
            const int64_t ih = h0 + tap_h[tap], iw = w0 + tap_w[tap];
            if (ih < 0 || ih >= s.in_h || iw < 0 || iw >= s.in_w) {
              valid = false;
              return;
            }
            visit(o + k, in0 + ih * row + iw * c + k, t < 0);
          }
        }
      }
    }
  });
  return valid;
}

// The calling thread's int32 index row of n entries, narrowed into taps
// after each unit. Declared here, not in MaxPoolTaps: a function's
// thread_local is constructed in the threads that run its declaration, and
// the pool's workers run only the lambdas.
int32_t* IndexRow(int64_t n) {
  thread_local std::vector<int32_t> row;
  if (static_cast<int64_t>(row.size()) < n) row.resize(n);
  return row.data();
}

}  // namespace

void MaxPoolArgmax(const ConvShape& s, const float* x, float* y,
                   int32_t* argmax, const ParallelFor& parallel_for) {
  const int64_t row = s.in_w * s.in_c;
  PoolUnits(
      s, x, y, /*step=*/1,
      [&](int64_t ih, int64_t iw, int64_t, int64_t) {
        return static_cast<int32_t>(ih * row + iw * s.in_c);
      },
      [&](int64_t u) { return argmax + u * s.out_w * s.in_c; },
      [](int64_t, int32_t*) {}, parallel_for);
}

void MaxPoolTaps(const ConvShape& s, const float* x, bool relu, float* y,
                 int8_t* taps, const ParallelFor& parallel_for) {
  const int64_t n = s.out_w * s.in_c;
  PoolUnits(
      s, x, y, /*step=*/0,
      [&](int64_t ih, int64_t iw, int64_t h0, int64_t w0) {
        return static_cast<int32_t>((ih - h0) * s.k_w + (iw - w0));
      },
      [&](int64_t) { return IndexRow(n); },
      [&](int64_t u, int32_t* where) {
        const float* best = y + u * n;
        int8_t* out = taps + u * n;
        for (int64_t k = 0; k < n; ++k) {
          const int8_t tap = static_cast<int8_t>(where[k]);
          out[k] = where[k] < 0                ? kNoTap
                   : relu && !(best[k] > 0.0f) ? static_cast<int8_t>(~tap)
                                               : tap;
        }
      },
      parallel_for);
}

bool MaxPoolTapsBackprop(const ConvShape& s, const float* dy,
                         const int8_t* taps, bool relu, float* dx,
                         const ParallelFor& parallel_for) {
  // Each image's dx zeroed by the thread that scatters into it, just before
  // (in parallel, and still in cache for the first windows).
  const int64_t image = s.in_h * s.in_w * s.in_c;
  if (!ForEachTap(
          s, taps, parallel_for,
          [&](int64_t o, int64_t i, bool) { dx[i] += dy[o]; },
          [&](int64_t n) {
            std::fill(dx + n * image, dx + (n + 1) * image, 0.0f);
          })) {
    return false;
  }
  if (!relu) return true;
  // ReluGrad's product by (r > 0) at the positions dead taps name (all taps
  // naming a position agree on it, r being that position's value).
  return ForEachTap(
      s, taps, parallel_for,
      [&](int64_t, int64_t i, bool dead) {
        if (dead) dx[i] *= 0.0f;
      },
      [](int64_t) {});
}

bool MaxPoolTapsGather(const ConvShape& s, const float* v, const int8_t* taps,
                       bool relu, float* out, const ParallelFor& parallel_for) {
  const int64_t image = s.out_h * s.out_w * s.in_c;
  return ForEachTap(
      s, taps, parallel_for,
      [&](int64_t o, int64_t i, bool dead) {
        out[o] = relu && dead ? v[i] * 0.0f : v[i];
      },
      [&](int64_t n) {
        std::fill(out + n * image, out + (n + 1) * image, 0.0f);
      });
}

}  // namespace tapehook
