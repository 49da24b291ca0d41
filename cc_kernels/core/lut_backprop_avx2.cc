// Sign-table dW on AVX2 (see lut_backprop_avx2.h for the idea).
//
// Sign convention of every index: bit 1 <=> -1 (t < 0 or NaN), bit 0 <=> +1.
// The sign vectors S_i[j] = (j >> i) & 1 ? -1 : +1 make a table from three
// floats with one multiply and two FMAs: T = d0 S0 + d1 S1 + d2 S2.
#include "lut_backprop_avx2.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu.h"
#include "lut_common.h"
#include "pack_input.h"
#include "simd_avx2.h"

namespace tapehook {
namespace lut_avx2 {

bool Usable() { return TAPEHOOK_HAVE_AVX2_PATH && cpu::Avx2(); }

#if TAPEHOOK_HAVE_AVX2_PATH

namespace {

using lut_common::DwTaps;
using lut_common::kNegSigns;
using lut_common::PaddingCorrection;
using lut_common::Scratch;
using lut_common::TapsOf;

// Position groups per K chunk (48 measured best of 48 / 64 / 96 / 192 at
// Bi-Real-Net's shapes on a Zen 3: one tile's tables stay in L1) and output
// channels per slice (a multiple of both tiles' channel counts, 12 and 6).
constexpr int64_t kChunk = 48;
constexpr int64_t kSlice = 48;

struct Geometry {
  int64_t n, h, w, ci, oh, ow, co, kh, kw, sh, sw, pt, pl;
  int64_t ci_pad;         // ci rounded up to 8 lanes
  int64_t cb;             // 8-lane input channel blocks
  int64_t nb;             // triples of images: a position group is one output
                          // pixel in 3 consecutive images
  int64_t nih, niw;       // the triple image's rows and columns
  int64_t b, ncbb, cmax;  // blocks per tile, cb / b, channels per tile
  int lb;                 // log2 b
};

Geometry GeometryOf(const ConvShape& s) {
  Geometry g;
  g.n = s.batch, g.h = s.in_h, g.w = s.in_w, g.ci = s.in_c;
  g.oh = s.out_h, g.ow = s.out_w, g.co = s.out_c, g.kh = s.k_h, g.kw = s.k_w;
  g.sh = s.stride_h, g.sw = s.stride_w, g.pt = s.pad_top, g.pl = s.pad_left;
  g.ci_pad = RoundUp(g.ci, 8);
  g.cb = g.ci_pad / 8;
  g.nb = (g.n + 2) / 3;
  g.nih = (g.oh - 1) * g.sh + g.kh;
  g.niw = (g.ow - 1) * g.sw + g.kw;
  g.lb = g.cb % 2 == 0 ? 1 : 0;
  g.b = int64_t{1} << g.lb;
  g.ncbb = g.cb / g.b;
  g.cmax = g.b == 2 ? 6 : 12;
  return g;
}

// The sign vectors as floats (initialized without AVX2 instructions, so that
// loading the library runs none).
struct SignRows {
  alignas(32) float v[3][8];
  alignas(32) int32_t lane_bit[8];
  SignRows() {
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 8; ++j) v[i][j] = ((j >> i) & 1) ? -1.f : 1.f;
    }
    for (int j = 0; j < 8; ++j) lane_bit[j] = 1 << j;
  }
};
const SignRows kSignRows;

struct Signs {
  __m256 s[3];
};

TAPEHOOK_AVX2 inline Signs LoadSigns() {
  Signs S;
  for (int i = 0; i < 3; ++i) S.s[i] = _mm256_load_ps(kSignRows.v[i]);
  return S;
}

TAPEHOOK_AVX2 inline __m256 MakeTable(const Signs& S, float d0, float d1,
                                      float d2) {
  __m256 t = _mm256_mul_ps(_mm256_set1_ps(d0), S.s[0]);
  t = _mm256_fmadd_ps(_mm256_set1_ps(d1), S.s[1], t);
  return _mm256_fmadd_ps(_mm256_set1_ps(d2), S.s[2], t);
}

// Signs of x, 8 channels to a byte (bit 1 <=> -1, 0 past ci): pixels
// [p0, p1) of a float x.
TAPEHOOK_AVX2 void SignsOfFloats(const float* x, int64_t ci, int64_t cb,
                                 int64_t p0, int64_t p1, uint8_t* bits) {
  const __m256 zero = _mm256_setzero_ps();
  const int64_t full = ci / 8;
  for (int64_t p = p0; p < p1; ++p) {
    const float* xr = x + p * ci;
    for (int64_t j = 0; j < full; ++j) {
      const __m256 v = _mm256_loadu_ps(xr + 8 * j);
      bits[p * cb + j] = static_cast<uint8_t>(
          _mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NGE_UQ)));
    }
    if (full < cb) {
      unsigned m = 0;
      for (int64_t c = 8 * full; c < ci; ++c) {
        m |= unsigned{!(xr[c] >= 0.0f)} << (c - 8 * full);
      }
      bits[p * cb + full] = static_cast<uint8_t>(m);
    }
  }
}

// The same from the packed format (two packed bytes per 8 channels).
void SignsOfPacked(const uint8_t* packed, int64_t ci, int64_t cb, int64_t p0,
                   int64_t p1, uint8_t* bits) {
  const int64_t row_bytes = PackedBytes(ci);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* r = packed + p * row_bytes;
    for (int64_t j = 0; j < cb; ++j) {
      unsigned m = kNegSigns.v[r[2 * j]];
      if (2 * j + 1 < row_bytes) m |= unsigned{kNegSigns.v[r[2 * j + 1]]} << 4;
      const int64_t valid = std::min<int64_t>(8, ci - 8 * j);
      if (valid < 8) m &= (1u << valid) - 1;
      bits[p * cb + j] = static_cast<uint8_t>(m);
    }
  }
}

// Triple image TI[nb][r][c][ci_pad] int32, r = ih + pt in [0, nih), c = iw
// + pl in [0, niw): bit i = sign bit of x(3 nb + i, ih, iw), i < 3 (0, i.e.
// +1, outside the image or past the batch). Rows nr = nb * nih + r in
// [r0, r1).
TAPEHOOK_AVX2 void TripleRows(const Geometry& g, const uint8_t* bits,
                              int64_t r0, int64_t r1, int32_t* ti) {
  const __m256i lane_bit =
      _mm256_load_si256(reinterpret_cast<const __m256i*>(kSignRows.lane_bit));
  for (int64_t nr = r0; nr < r1; ++nr) {
    const int64_t n0 = nr / g.nih * 3, ih = nr % g.nih - g.pt;
    int32_t* row = ti + nr * g.niw * g.ci_pad;
    if (ih < 0 || ih >= g.h) {
      std::memset(row, 0, sizeof(int32_t) * g.niw * g.ci_pad);
      continue;
    }
    for (int64_t c = 0; c < g.niw; ++c) {
      const int64_t iw = c - g.pl;
      for (int64_t j = 0; j < g.cb; ++j) {
        __m256i v = _mm256_setzero_si256();
        for (int i = 0; i < 3; ++i) {
          if (iw < 0 || iw >= g.w || n0 + i >= g.n) continue;
          const uint8_t* xr = bits + ((n0 + i) * g.h + ih) * g.w * g.cb;
          const __m256i m = _mm256_set1_epi32(xr[iw * g.cb + j]);
          const __m256i set =
              _mm256_cmpeq_epi32(_mm256_and_si256(m, lane_bit), lane_bit);
          v = _mm256_or_si256(v,
                              _mm256_and_si256(set, _mm256_set1_epi32(1 << i)));
        }
        _mm256_store_si256(
            reinterpret_cast<__m256i*>(row + c * g.ci_pad + j * 8), v);
      }
    }
  }
}

// B channel blocks x C output channels, over ngroups position groups.
// acc layout [co][ci_pad] (ci contiguous), acc_stride floats per co.
template <int B, int C>
TAPEHOOK_AVX2 void Tile(const int32_t* ti, const int64_t* goff, int64_t tapoff,
                        const float* tab, int64_t tab_stride, int64_t ngroups,
                        float* acc_out, int64_t acc_stride) {
  __m256 acc[B][C];
#pragma GCC unroll 2
  for (int b = 0; b < B; ++b) {
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) {
      acc[b][c] = _mm256_load_ps(acc_out + c * acc_stride + b * 8);
    }
  }
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    const int32_t* ip = ti + goff[gi] + tapoff;
    const float* tp = tab + gi * tab_stride;
    __m256i ix[B];
#pragma GCC unroll 2
    for (int b = 0; b < B; ++b) {
      ix[b] = _mm256_load_si256(reinterpret_cast<const __m256i*>(ip + b * 8));
    }
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) {
      __m256 table = _mm256_load_ps(tp + c * 8);
      // One load per table: folded into each vpermps (as GCC does unasked)
      // it costs a load per use, and measured 1.65 against 2.08 G pairs/s.
      if (B > 1) __asm__("" : "+x"(table));
#pragma GCC unroll 2
      for (int b = 0; b < B; ++b) {
        acc[b][c] =
            _mm256_add_ps(acc[b][c], _mm256_permutevar8x32_ps(table, ix[b]));
      }
    }
  }
#pragma GCC unroll 2
  for (int b = 0; b < B; ++b) {
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(acc_out + c * acc_stride + b * 8, acc[b][c]);
    }
  }
}

using TileFn = void (*)(const int32_t*, const int64_t*, int64_t, const float*,
                        int64_t, int64_t, float*, int64_t);

template <int B, int... Cs>
void FillTiles(TileFn* table, std::integer_sequence<int, Cs...>) {
  ((table[Cs + 1] = &Tile<B, Cs + 1>), ...);
}

// kTiles.k[log2 B][C]: 12 output channels for B = 1, 6 for B = 2 (12
// accumulators, B indices and a table: at most 15 of the 16 ymm).
struct Tiles {
  TileFn k[2][13] = {};
  Tiles() {
    FillTiles<1>(k[0], std::make_integer_sequence<int, 12>());
    FillTiles<2>(k[1], std::make_integer_sequence<int, 6>());
  }
};
const Tiles kTiles;

// dW columns [co_begin, co_end), in slices of up to kSlice channels: per
// slice, acc[tap][csn][ci_pad] over K chunks of position groups, then the
// padding correction and the transpose into HWIO.
TAPEHOOK_AVX2 void Columns(const Geometry& g, const DwTaps& taps,
                           const int32_t* ti, const float* dy, int64_t co_begin,
                           int64_t co_end, float* dw) {
  const Signs S = LoadSigns();
  const int64_t ntaps = g.kh * g.kw;
  const int64_t total_groups = g.nb * g.oh * g.ow;
  const int64_t ti_img = g.nih * g.niw * g.ci_pad;
  Scratch<float> tab(kChunk * kSlice * 8);
  Scratch<float> acc(ntaps * kSlice * g.ci_pad);
  std::vector<int64_t> goff(kChunk);
  std::vector<float> corr(ntaps * kSlice);
  std::vector<float> border_sum(taps.border.size() * kSlice);
  for (int64_t cs0 = co_begin; cs0 < co_end; cs0 += kSlice) {
    const int64_t csn = std::min(kSlice, co_end - cs0);
    std::memset(acc.get(), 0, sizeof(float) * ntaps * csn * g.ci_pad);
    for (int64_t k0 = 0; k0 < total_groups; k0 += kChunk) {
      const int64_t kc = std::min(kChunk, total_groups - k0);
      // Tables [group][co in slice][8] and the groups' triple offsets.
      for (int64_t gi = 0; gi < kc; ++gi) {
        const int64_t gg = k0 + gi;
        const int64_t b = gg / (g.oh * g.ow), pix = gg % (g.oh * g.ow);
        const int64_t o = pix / g.ow, x = pix % g.ow;
        goff[gi] = b * ti_img + (o * g.sh * g.niw + x * g.sw) * g.ci_pad;
        const int64_t img = g.oh * g.ow * g.co;  // dy floats per image
        const float* d = dy + (3 * b * g.oh * g.ow + pix) * g.co + cs0;
        float* dst = tab.get() + gi * csn * 8;
        const int64_t valid = std::min<int64_t>(3, g.n - 3 * b);
        if (valid == 3) {
          for (int64_t c = 0; c < csn; ++c) {
            _mm256_store_ps(dst + c * 8,
                            MakeTable(S, d[c], d[c + img], d[c + 2 * img]));
          }
        } else {
          for (int64_t c = 0; c < csn; ++c) {
            float v[3] = {0, 0, 0};
            for (int64_t i = 0; i < valid; ++i) v[i] = d[c + i * img];
            _mm256_store_ps(dst + c * 8, MakeTable(S, v[0], v[1], v[2]));
          }
        }
      }
      for (int64_t c0 = 0; c0 < csn; c0 += g.cmax) {
        const int64_t nc = std::min(g.cmax, csn - c0);
        for (int64_t tap = 0; tap < ntaps; ++tap) {
          if (!taps.live[tap]) continue;
          const int64_t tapoff = (tap / g.kw * g.niw + tap % g.kw) * g.ci_pad;
          for (int64_t cbblk = 0; cbblk < g.ncbb; ++cbblk) {
            kTiles.k[g.lb][nc](
                ti + cbblk * g.b * 8, goff.data(), tapoff, tab.get() + c0 * 8,
                csn * 8, kc,
                acc.get() + (tap * csn + c0) * g.ci_pad + cbblk * g.b * 8,
                g.ci_pad);
          }
        }
      }
    }
    // Zero padding: the kernel counted padded taps as +1; subtract
    // corr[tap][co] = the sum of dy over the positions where tap is padding.
    PaddingCorrection(g, taps, dy, cs0, csn, kSlice, &border_sum, &corr);
    // acc [tap][co][ci] -> dw [tap][ci][co] minus corr; taps that never
    // meet the input are exact zeros.
    for (int64_t tap = 0; tap < ntaps; ++tap) {
      const float* a = acc.get() + tap * csn * g.ci_pad;
      const float* cv = corr.data() + tap * kSlice;
      for (int64_t i = 0; i < g.ci; ++i) {
        float* out = dw + (tap * g.ci + i) * g.co + cs0;
        if (!taps.live[tap]) {
          std::fill_n(out, csn, 0.0f);
          continue;
        }
        for (int64_t c = 0; c < csn; ++c) out[c] = a[c * g.ci_pad + i] - cv[c];
      }
    }
  }
}

// dW from the sign bits of x ([pixel][cb] bytes).
void FilterFromSigns(const Geometry& g, const uint8_t* bits, const float* dy,
                     float* dw, const ParallelFor& parallel_for) {
  Scratch<int32_t> ti(g.nb * g.nih * g.niw * g.ci_pad);
  parallel_for(g.nb * g.nih, g.niw * g.ci_pad * 4, [&](int64_t r0, int64_t r1) {
    TripleRows(g, bits, r0, r1, ti.get());
  });
  const DwTaps taps = TapsOf(g);
  // Units of 12 output channels (whole tiles: 12 or 2 x 6), one even shard
  // per thread: every shard reads the whole triple image once per 6 or 12
  // of its channels, so TF's 4 shards per thread cost 30 % (16.0 against
  // 12.3 ms at 28x28x64, batch 32, 2 threads).
  constexpr int64_t kUnit = 12;
  const int64_t units = (g.co + kUnit - 1) / kUnit;
  parallel_for(units, kEvenShards, [&](int64_t u0, int64_t u1) {
    Columns(g, taps, ti.get(), dy, kUnit * u0, std::min(g.co, kUnit * u1), dw);
  });
}

// Whether the engine runs this conv now (with every size known).
bool Runs(const ConvShape& s) {
  return Usable() && s.dil_h == 1 && s.dil_w == 1 && s.batch > 0 &&
         s.in_h > 0 && s.in_w > 0 && s.in_c > 0 && s.out_c > 0 && s.out_h > 0 &&
         s.out_w > 0 && s.k_h > 0 && s.k_w > 0;
}

// The engine on the sign bits that signs(g, p0, p1, bits) writes for
// pixels [p0, p1) of x; false where it does not run (Runs).
template <typename SignsFn>
bool FromInput(const ConvShape& s, const float* dy, float* dw,
               const ParallelFor& parallel_for, const SignsFn& signs) {
  if (!Runs(s)) return false;
  const Geometry g = GeometryOf(s);
  const int64_t pixels = g.n * g.h * g.w;
  Scratch<uint8_t> bits(pixels * g.cb);
  parallel_for(pixels, g.ci,
               [&](int64_t p0, int64_t p1) { signs(g, p0, p1, bits.get()); });
  FilterFromSigns(g, bits.get(), dy, dw, parallel_for);
  return true;
}

}  // namespace

bool BackpropFilter(const ConvShape& s, const float* x, const float* dy,
                    float* dw, const ParallelFor& parallel_for) {
  return FromInput(
      s, dy, dw, parallel_for,
      [&](const Geometry& g, int64_t p0, int64_t p1, uint8_t* bits) {
        SignsOfFloats(x, g.ci, g.cb, p0, p1, bits);
      });
}

bool BackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                          const float* dy, float* dw,
                          const ParallelFor& parallel_for) {
  return FromInput(
      s, dy, dw, parallel_for,
      [&](const Geometry& g, int64_t p0, int64_t p1, uint8_t* bits) {
        SignsOfPacked(packed, g.ci, g.cb, p0, p1, bits);
      });
}

#else  // !TAPEHOOK_HAVE_AVX2_PATH

bool BackpropFilter(const ConvShape&, const float*, const float*, float*,
                    const ParallelFor&) {
  return false;
}
bool BackpropFilterPacked(const ConvShape&, const uint8_t*, const float*,
                          float*, const ParallelFor&) {
  return false;
}

#endif  // TAPEHOOK_HAVE_AVX2_PATH

}  // namespace lut_avx2
}  // namespace tapehook
