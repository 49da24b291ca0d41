#include "batch_norm.h"

#include <algorithm>
#include <vector>

namespace tapehook {

namespace {

// Rows per block of the channel sums: fixed, so the float64 partial sums
// and the order they are added in do not depend on the threads.
constexpr int64_t kRowsPerBlock = 512;

}  // namespace

void BatchNormGrad(const float* dy, const float* x, int64_t rows,
                   int64_t channels, const float* scale, const float* mean,
                   const float* inv_std, bool relu, float* dx, float* dscale,
                   float* doffset, const ParallelFor& parallel_for) {
  const int64_t blocks =
      std::max<int64_t>(1, (rows + kRowsPerBlock - 1) / kRowsPerBlock);
  // Per block and channel: sum dy, sum dy * (x' - mean).
  std::vector<double> sums(static_cast<size_t>(blocks * channels * 2), 0.0);
  parallel_for(
      blocks, kRowsPerBlock * channels * 4, [&](int64_t lo, int64_t hi) {
        std::vector<float> s_dy(channels), s_dyx(channels);
        for (int64_t b = lo; b < hi; ++b) {
          std::fill(s_dy.begin(), s_dy.end(), 0.0f);
          std::fill(s_dyx.begin(), s_dyx.end(), 0.0f);
          const int64_t r_end = std::min(rows, (b + 1) * kRowsPerBlock);
          for (int64_t r = b * kRowsPerBlock; r < r_end; ++r) {
            const float* g = dy + r * channels;
            const float* v = x + r * channels;
            for (int64_t c = 0; c < channels; ++c) {
              const float xv = relu ? std::max(v[c], 0.0f) : v[c];
              s_dy[c] += g[c];
              s_dyx[c] += g[c] * (xv - mean[c]);
            }
          }
          double* out = sums.data() + b * channels * 2;
          for (int64_t c = 0; c < channels; ++c) {
            out[c] = s_dy[c];
            out[channels + c] = s_dyx[c];
          }
        }
      });
  std::vector<float> a(channels), k(channels), off(channels);
  const double m = static_cast<double>(rows);
  for (int64_t c = 0; c < channels; ++c) {
    double sum_dy = 0.0, sum_dyx = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      sum_dy += sums[b * channels * 2 + c];
      sum_dyx += sums[b * channels * 2 + channels + c];
    }
    const double inv = inv_std[c];
    doffset[c] = static_cast<float>(sum_dy);
    dscale[c] = static_cast<float>(sum_dyx * inv);
    // dx = a * dy - k * (x' - mean) - off, per channel.
    a[c] = static_cast<float>(scale[c] * inv);
    k[c] = static_cast<float>(scale[c] * inv * inv * inv * sum_dyx / m);
    off[c] = static_cast<float>(scale[c] * inv * sum_dy / m);
  }
  parallel_for(rows, channels * 6, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* g = dy + r * channels;
      const float* v = x + r * channels;
      float* o = dx + r * channels;
      for (int64_t c = 0; c < channels; ++c) {
        const float xv = relu ? std::max(v[c], 0.0f) : v[c];
        const float d = a[c] * g[c] - k[c] * (xv - mean[c]) - off[c];
        o[c] = relu && !(v[c] > 0.0f) ? 0.0f : d;
      }
    }
  });
}

}  // namespace tapehook
