// Small helpers the binary conv kernels share: sign, sizes, alpha, pixel
// positions.
#ifndef TAPEHOOK_CORE_CONV_UTIL_H_
#define TAPEHOOK_CORE_CONV_UTIL_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "estimator.h"
#include "geometry.h"

namespace tapehook {

template <typename T>
inline T Sign(T t) {
  return t >= T(0) ? T(1) : T(-1);
}

inline int64_t FilterSize(const ConvShape& s) { return s.k_h * s.k_w * s.in_c; }
inline int64_t OutPixels(const ConvShape& s) {
  return s.batch * s.out_h * s.out_w;
}

// alpha[o] per output channel.
template <typename T>
std::vector<double> Alpha(const ConvShape& s, const T* w, Scale scale) {
  const int64_t K = FilterSize(s);
  const int64_t N = s.out_c;
  std::vector<double> alpha(N, 1.0);
  if (scale == Scale::kMeanAbs) {
    std::vector<double> sum(N, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t o = 0; o < N; ++o) sum[o] += std::abs(double(w[k * N + o]));
    }
    for (int64_t o = 0; o < N; ++o) alpha[o] = sum[o] / double(K);
  }
  return alpha;
}

// Decomposes a flat output pixel index into (n, oh, ow).
struct PixelPos {
  int64_t n, oh, ow;
};
inline PixelPos Pos(const ConvShape& s, int64_t pix) {
  const int64_t hw = s.out_h * s.out_w;
  const int64_t r = pix % hw;
  return {pix / hw, r / s.out_w, r % s.out_w};
}

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_CONV_UTIL_H_
