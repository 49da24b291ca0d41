// What the sign-table engines (lut_backprop.cc at AVX-512 width,
// lut_backprop_avx2.cc at AVX2 width) share and that has no SIMD in it:
// pooled scratch, the dW taps that ever meet the input and the output
// positions where some tap is padding, and the packed format's negated sign
// bits.
#ifndef TAPEHOOK_CORE_LUT_COMMON_H_
#define TAPEHOOK_CORE_LUT_COMMON_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_runtime.h"  // the scratch pool (amx::Pool)
#include "geometry.h"

namespace tapehook {
namespace lut_common {

// Scratch from the kernels' pool (fresh multi-MiB blocks cost a page fault
// per 4 KiB); 64-byte aligned, contents undefined.
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t n)
      : p_(static_cast<T*>(
            amx::Pool().Take(static_cast<size_t>(n) * sizeof(T)))) {}
  ~Scratch() { amx::Pool().Give(p_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* get() const { return p_; }

 private:
  T* p_;
};

// Whether tap (a, b) reads zero padding at output position p (oh * ow +
// ow_). G: any geometry with the conv's h, w, ow, sh, sw, pt, pl.
template <typename G>
bool TapPadded(const G& g, int64_t a, int64_t b, int64_t p) {
  const int64_t ih = p / g.ow * g.sh + a - g.pt;
  const int64_t iw = p % g.ow * g.sw + b - g.pl;
  return ih < 0 || ih >= g.h || iw < 0 || iw >= g.w;
}

// What dW needs besides the signs of x: which taps ever meet the input, and
// the output positions where some tap is padding.
struct DwTaps {
  std::vector<char> live;       // [tap]
  std::vector<int64_t> border;  // output positions oh * ow + ow_
};

template <typename G>
DwTaps TapsOf(const G& g) {
  DwTaps t;
  t.live.assign(g.kh * g.kw, 0);
  for (int64_t a = 0; a < g.kh; ++a) {
    bool row = false;
    for (int64_t o = 0; o < g.oh && !row; ++o) {
      const int64_t ih = o * g.sh + a - g.pt;
      row = ih >= 0 && ih < g.h;
    }
    for (int64_t b = 0; b < g.kw; ++b) {
      bool col = false;
      for (int64_t x = 0; x < g.ow && !col; ++x) {
        const int64_t iw = x * g.sw + b - g.pl;
        col = iw >= 0 && iw < g.w;
      }
      t.live[a * g.kw + b] = row && col;
    }
  }
  for (int64_t p = 0; p < g.oh * g.ow; ++p) {
    bool padded = false;
    for (int64_t a = 0; a < g.kh && !padded; ++a) {
      for (int64_t b = 0; b < g.kw && !padded; ++b) {
        padded = TapPadded(g, a, b, p);
      }
    }
    if (padded) t.border.push_back(p);
  }
  return t;
}

// corr[tap * stride + c], c < csn: the sum of dy[., cs0 + c] over the
// positions where tap reads padding (the engines count padding as +1 and
// subtract this). dy is NHWC with g.co channels; border_sum is scratch.
template <typename G>
void PaddingCorrection(const G& g, const DwTaps& taps, const float* dy,
                       int64_t cs0, int64_t csn, int64_t stride,
                       std::vector<float>* border_sum,
                       std::vector<float>* corr) {
  std::fill(corr->begin(), corr->end(), 0.0f);
  if (taps.border.empty()) return;
  std::fill(border_sum->begin(), border_sum->end(), 0.0f);
  for (int64_t n = 0; n < g.n; ++n) {
    for (size_t i = 0; i < taps.border.size(); ++i) {
      const float* d = dy + (n * g.oh * g.ow + taps.border[i]) * g.co + cs0;
      float* s = border_sum->data() + i * stride;
      for (int64_t c = 0; c < csn; ++c) s[c] += d[c];
    }
  }
  for (int64_t tap = 0; tap < g.kh * g.kw; ++tap) {
    float* c = corr->data() + tap * stride;
    for (size_t i = 0; i < taps.border.size(); ++i) {
      if (!TapPadded(g, tap / g.kw, tap % g.kw, taps.border[i])) continue;
      const float* s = border_sum->data() + i * stride;
      for (int64_t j = 0; j < csn; ++j) c[j] += s[j];
    }
  }
}

// kNegSigns.v[byte]: the negated sign bits of a packed byte's 4 channels
// (pack_input.h: channel i's sign, 1 for x >= 0, at bit 7 - 2 i), channel i
// at bit i.
struct NegSigns {
  uint8_t v[256];
  NegSigns() {
    for (int byte = 0; byte < 256; ++byte) {
      int m = 0;
      for (int i = 0; i < 4; ++i) m |= ((byte >> (7 - 2 * i) & 1) ^ 1) << i;
      v[byte] = static_cast<uint8_t>(m);
    }
  }
};
inline const NegSigns kNegSigns;

}  // namespace lut_common
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_LUT_COMMON_H_
