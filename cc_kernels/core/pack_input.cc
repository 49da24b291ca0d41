#include "pack_input.h"

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
                  uint8_t* packed, const ParallelFor& parallel_for) {
  const int64_t bytes = PackedBytes(channels);
  const T limit = static_cast<T>(clip);
  bool wide = false;
#if TAPEHOOK_HAVE_PACK512
  wide = std::is_same<T, float>::value && cpu::PackInput512();
#endif
  parallel_for(rows, channels * 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if TAPEHOOK_HAVE_PACK512
      if constexpr (std::is_same<T, float>::value) {
        if (wide) {
          PackRow512(x + r * channels, channels, limit, packed + r * bytes);
          continue;
        }
      }
#endif
      PackRowPortable(x + r * channels, channels, limit, packed + r * bytes);
    }
  });
}

namespace {

template <typename T>
void UnpackRowPortable(const uint8_t* in, int64_t channels, T* x_hat, T* mask) {
  for (int64_t c = 0; c < channels; ++c) {
    const int bits = (in[c / 4] >> (6 - 2 * static_cast<int>(c % 4))) & 3;
    x_hat[c] = (bits & 2) ? T(1) : T(-1);
    mask[c] = (bits & 1) ? T(1) : T(0);
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
    _mm512_storeu_ps(mask + c,
                     _mm512_maskz_mov_ps(static_cast<__mmask16>(keep), one));
  }
  UnpackRowPortable(in + c / 4, channels - c, x_hat + c, mask + c);
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
                       mask + r * channels);
          continue;
        }
      }
#endif
      UnpackRowPortable(packed + r * bytes, channels, x_hat + r * channels,
                        mask + r * channels);
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
