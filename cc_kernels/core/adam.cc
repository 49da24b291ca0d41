#include "adam.h"

// Each product and sum rounded on its own, as TF's kernel (built without
// FMA) rounds them: GCC would otherwise fuse the intrinsics' mul + add.
#pragma GCC optimize("fp-contract=off")

#include <cmath>

#include "cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define TAPEHOOK_HAVE_ADAM_SIMD 1
#endif

namespace tapehook {

namespace {

// Elements per shard: whole cache lines of all four arrays, and enough work
// per shard to outweigh scheduling.
constexpr int64_t kBlock = 16 * 1024;

// The comparisons are written so that a NaN passes through (as
// tf.clip_by_value's Maximum / Minimum leave it).
inline float Clip(float x, float clip) {
  return x < -clip ? -clip : (x > clip ? clip : x);
}

void UpdatePortable(float* var, float* m, float* v, const float* g, int64_t n,
                    const AdamStep& s) {
  for (int64_t i = 0; i < n; ++i) {
    const float mi = m[i] + (g[i] - m[i]) * s.one_minus_beta1;
    const float vi = v[i] + (g[i] * g[i] - v[i]) * s.one_minus_beta2;
    m[i] = mi;
    v[i] = vi;
    const float step = (mi * s.alpha) / (std::sqrt(vi) + s.epsilon);
    var[i] = Clip(var[i] - step, s.clip);
  }
}

#if TAPEHOOK_HAVE_ADAM_SIMD
// max_ps / min_ps return their second operand where either is NaN: with the
// clip bound first, a NaN update stays NaN.
__attribute__((target("avx512f"))) void Update512(float* var, float* m,
                                                  float* v, const float* g,
                                                  int64_t n,
                                                  const AdamStep& s) {
  const __m512 b1 = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 alpha = _mm512_set1_ps(s.alpha);
  const __m512 eps = _mm512_set1_ps(s.epsilon);
  const __m512 hi = _mm512_set1_ps(s.clip), lo = _mm512_set1_ps(-s.clip);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gi = _mm512_loadu_ps(g + i);
    __m512 mi = _mm512_loadu_ps(m + i), vi = _mm512_loadu_ps(v + i);
    mi = _mm512_add_ps(mi, _mm512_mul_ps(_mm512_sub_ps(gi, mi), b1));
    vi = _mm512_add_ps(
        vi, _mm512_mul_ps(_mm512_sub_ps(_mm512_mul_ps(gi, gi), vi), b2));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    const __m512 step = _mm512_div_ps(_mm512_mul_ps(mi, alpha),
                                      _mm512_add_ps(_mm512_sqrt_ps(vi), eps));
    const __m512 w = _mm512_sub_ps(_mm512_loadu_ps(var + i), step);
    _mm512_storeu_ps(var + i, _mm512_min_ps(hi, _mm512_max_ps(lo, w)));
  }
  UpdatePortable(var + i, m + i, v + i, g + i, n - i, s);
}

__attribute__((target("avx2"))) void Update256(float* var, float* m, float* v,
                                               const float* g, int64_t n,
                                               const AdamStep& s) {
  const __m256 b1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 alpha = _mm256_set1_ps(s.alpha);
  const __m256 eps = _mm256_set1_ps(s.epsilon);
  const __m256 hi = _mm256_set1_ps(s.clip), lo = _mm256_set1_ps(-s.clip);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    __m256 mi = _mm256_loadu_ps(m + i), vi = _mm256_loadu_ps(v + i);
    mi = _mm256_add_ps(mi, _mm256_mul_ps(_mm256_sub_ps(gi, mi), b1));
    vi = _mm256_add_ps(
        vi, _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(gi, gi), vi), b2));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    const __m256 step = _mm256_div_ps(_mm256_mul_ps(mi, alpha),
                                      _mm256_add_ps(_mm256_sqrt_ps(vi), eps));
    const __m256 w = _mm256_sub_ps(_mm256_loadu_ps(var + i), step);
    _mm256_storeu_ps(var + i, _mm256_min_ps(hi, _mm256_max_ps(lo, w)));
  }
  UpdatePortable(var + i, m + i, v + i, g + i, n - i, s);
}
#endif

}  // namespace

AdamStep AdamScalars(float lr, float beta1_power, float beta2_power,
                     float beta1, float beta2, float epsilon, float clip) {
  AdamStep s;
  s.alpha = lr * std::sqrt(1.0f - beta2_power) / (1.0f - beta1_power);
  s.one_minus_beta1 = 1.0f - beta1;
  s.one_minus_beta2 = 1.0f - beta2;
  s.epsilon = epsilon;
  s.clip = clip;
  return s;
}

void AdamClipUpdate(float* var, float* m, float* v, const float* grad,
                    int64_t n, const AdamStep& step,
                    const ParallelFor& parallel_for) {
  auto update = UpdatePortable;
#if TAPEHOOK_HAVE_ADAM_SIMD
  if (cpu::Float512()) {
    update = Update512;
  } else if (cpu::Avx2()) {
    update = Update256;
  }
#endif
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  parallel_for(blocks, kBlock * 8, [&](int64_t lo, int64_t hi) {
    const int64_t begin = lo * kBlock;
    const int64_t end = hi * kBlock < n ? hi * kBlock : n;
    update(var + begin, m + begin, v + begin, grad + begin, end - begin, step);
  });
}

}  // namespace tapehook
