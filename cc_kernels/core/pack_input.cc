#include "pack_input.h"

#include <cmath>
#include <cstring>

namespace tapehook {

template <typename T>
void PackSignMask(const T* x, int64_t rows, int64_t channels, double clip,
                  uint8_t* packed, const ParallelFor& parallel_for) {
  const int64_t bytes = PackedBytes(channels);
  const T limit = static_cast<T>(clip);
  parallel_for(rows, channels * 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* in = x + r * channels;
      uint8_t* out = packed + r * bytes;
      std::memset(out, 0, bytes);
      for (int64_t c = 0; c < channels; ++c) {
        const int shift = 6 - 2 * static_cast<int>(c % 4);
        const uint8_t bits = static_cast<uint8_t>(((in[c] >= T(0)) << 1) |
                                                  (std::abs(in[c]) <= limit));
        out[c / 4] |= static_cast<uint8_t>(bits << shift);
      }
    }
  });
}

template <typename T>
void UnpackSignMask(const uint8_t* packed, int64_t rows, int64_t channels,
                    T* x_hat, T* mask, const ParallelFor& parallel_for) {
  const int64_t bytes = PackedBytes(channels);
  parallel_for(rows, channels * 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* in = packed + r * bytes;
      for (int64_t c = 0; c < channels; ++c) {
        const int shift = 6 - 2 * static_cast<int>(c % 4);
        const int bits = (in[c / 4] >> shift) & 3;
        x_hat[r * channels + c] = (bits & 2) ? T(1) : T(-1);
        mask[r * channels + c] = (bits & 1) ? T(1) : T(0);
      }
    }
  });
}

template void PackSignMask<float>(const float*, int64_t, int64_t, double,
                                  uint8_t*, const ParallelFor&);
template void PackSignMask<double>(const double*, int64_t, int64_t, double,
                                   uint8_t*, const ParallelFor&);
template void UnpackSignMask<float>(const uint8_t*, int64_t, int64_t, float*,
                                    float*, const ParallelFor&);
template void UnpackSignMask<double>(const uint8_t*, int64_t, int64_t, double*,
                                     double*, const ParallelFor&);

}  // namespace tapehook
