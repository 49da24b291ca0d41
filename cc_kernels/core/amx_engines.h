// The two GEMM engines of the AMX kernels (amx_conv.cc): the shifted GEMM
// (forward, backprop-input) and the filter GEMM (backprop-filter), with the
// packing of their B operands and their stores.
#ifndef TAPEHOOK_CORE_AMX_ENGINES_H_
#define TAPEHOOK_CORE_AMX_ENGINES_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "amx_grid.h"
#include "amx_primitives.h"
#include "amx_runtime.h"
#include "geometry.h"

namespace tapehook {
namespace amx {

// ---------------------------------------------------------------------------
// Shifted GEMM: C[q, o] = sum_t sum_k A[q + off[t], k] * B_t[k, o].
// A: rows of 3 * kp bf16 (kp % 32 == 0; ARowStride apart): the hi, mid and lo
// parts of one pixel's k values, each part zero-padded to kp (2 * kp with
// `parts` == 2: hi and a rounded mid, binary_conv.h DySplit::kBf16x2). The
// parts multiply the same B, so B_t is [kp, o] and each B tile is loaded once
// for three A tiles. B: [o_pairs][taps][kp / 32][2 tiles][16 k-pairs][16
// cols][2] (AMX's pair-interleaved layout), so one o pair's B is contiguous.
//
// A is never materialized: each thread splits the rows it needs into a
// window of a few hundred KiB via fill(r0, r1, dst), so A stays in L2 and
// costs a read of the float input instead of a write and reads of 1.5x its
// size. Units walk all q for a group of o pairs whose B fills about 1 MiB of
// L2, then the next group (which splits the rows again).

// A's row stride in bf16 values: the 3 * kp of a row, plus one 64-byte
// line where that is an even number of lines. The rows of an A tile are
// then an odd number of lines apart and fall into 16 different L1 sets; at
// 3 * kp * 2 bytes (kp = 512: 48 lines) they fell into 4, and the forward
// and backprop-input re-read A from L2 (bench/backprops.py, 7x7x512).
inline int64_t ARowStride(int64_t kp, int parts = 3) {
  const int64_t lines = parts * kp / 32;
  return (lines % 2 == 0 ? lines + 1 : lines) * 32;
}

struct ShiftedGemm {
  int64_t kp;
  int parts = 3;  // of A's values (B holds exact +-1 / 0)
  const int64_t* off;
  int64_t taps;
  const uint16_t* b;
  int64_t o_pairs, q_pairs;
  int64_t o_group;  // o pairs per group
  std::function<void(int64_t r0, int64_t r1, uint16_t* dst)> fill;
  int64_t rows, max_off;  // rows [0, rows) of A exist; largest tap offset
  // Where phase_pairs > 0, output column pairs [f * phase_pairs, (f + 1) *
  // phase_pairs) have their own phase_taps[f] taps at phase_off[f] and B
  // phase_b[f] (laid out as b for phase_pairs pairs) instead of taps / off /
  // b: a strided backprop-input's phases, one A for all (amx_conv.cc).
  int64_t phase_pairs = 0;
  std::vector<int64_t> phase_taps;
  std::vector<const int64_t*> phase_off;
  std::vector<const uint16_t*> phase_b;
  int64_t units() const {
    return (o_pairs + o_group - 1) / o_group * q_pairs * o_group;
  }
};

// q pairs per window refill: about 512 KiB of rows, 4 to 32 pairs.
[[maybe_unused]] inline int64_t WindowPairs(int64_t ka) {
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
TAPEHOOK_AMX inline void ConfigureTiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  _tile_loadconfig(&cfg);
}

// Units [u0, u1) of g.units(): unit u is (group, q pair, o pair in group),
// in that order of significance. Tiles 0-3 accumulate the 2 x 2 block, 4-5
// hold A, 6-7 hold B.
TAPEHOOK_AMX inline void ShiftedGemmUnits(const ShiftedGemm& g, int64_t u0,
                                          int64_t u1, const BlockStore& store) {
  ConfigureTiles();
  alignas(64) float c[4][256];
  const int64_t chunks = g.kp / 32, ka = ARowStride(g.kp, g.parts);
  const int64_t lda = ka * 2;
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
    int64_t taps = g.taps;
    const int64_t* off = g.off;
    const uint16_t* bt = nullptr;
    if (g.phase_pairs > 0) {
      const int64_t f = op / g.phase_pairs;
      taps = g.phase_taps[f];
      off = g.phase_off[f];
      if (taps > 0)
        bt = g.phase_b[f] + op % g.phase_pairs * taps * chunks * 1024;
    } else {
      bt = g.b + op * g.taps * chunks * 1024;
    }
    for (int64_t t = 0; t < taps; ++t) {
      const uint16_t* a0 = a + (q0 - win_begin + off[t]) * ka;
      for (int64_t kc = 0; kc < chunks; ++kc, bt += 1024) {
        _tile_loadd(6, bt, 64);
        _tile_loadd(7, bt + 512, 64);
        for (int64_t part = 0; part < g.parts; ++part) {
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

// o pairs whose B (taps * kp / 32 tile pairs of 2 KiB each) fill about 1.5
// MiB of a 2 MiB L2, next to A's window of ~0.5 MiB. Each group splits dy's
// rows again, so a smaller bound costs mid-size images a second group and a
// larger one spills L2 (set by bench/backprops.py --plans amx;
// docs/performance.md).
inline int64_t OGroup(int64_t o_pairs, int64_t taps, int64_t kp) {
  const int64_t per_pair = taps * (kp / 32) * 2048;
  return std::max<int64_t>(1, std::min(o_pairs, (int64_t{3} << 19) / per_pair));
}

inline void RunShiftedGemm(const ShiftedGemm& g, const BlockStore& store,
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
// tap_of, when given, names W's tap for each of S's `taps` taps instead (no
// flip): a strided backprop-input's phase takes a subset of W's taps.
inline std::unique_ptr<Buffer> SignMatrix(const float* w, int64_t taps,
                                          int64_t C, int64_t O, bool transposed,
                                          int64_t kp, int64_t n_pad,
                                          const ParallelFor& parallel_for,
                                          const int64_t* tap_of = nullptr) {
  std::unique_ptr<Buffer> sm(new Buffer(taps * kp * n_pad));
  uint16_t* out = sm->p;
  parallel_for(taps, kp * n_pad, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint16_t* st = out + t * kp * n_pad;
      std::fill(st, st + kp * n_pad, uint16_t{0});
      const int64_t wt = tap_of       ? tap_of[t]
                         : transposed ? taps - 1 - t
                                      : t;  // W's tap
      if (!transposed) {
        for (int64_t c = 0; c < C; ++c) {
          const float* wr = w + (wt * C + c) * O;
          uint16_t* row = st + c * n_pad;
          for (int64_t o = 0; o < O; ++o) row[o] = SignBf16(wr[o]);
        }
        continue;
      }
      // Rows of sign W[wt] (c, o), 8 at a time, transposed into S.
      const int64_t o8 = RoundUp(O, 8);
      std::vector<uint16_t> rows(8 * o8);
      for (int64_t c0 = 0; c0 < C; c0 += 8) {
        std::fill(rows.begin(), rows.end(), uint16_t{0});
        for (int64_t c = c0; c < std::min(C, c0 + 8); ++c) {
          const float* wr = w + (wt * C + c) * O;
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
inline void PackShiftedB(const uint16_t* sm, int64_t taps, int64_t kp,
                         int64_t n_pad, uint16_t* b,
                         const ParallelFor& parallel_for) {
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
inline std::unique_ptr<Buffer> SignB(const float* w, int64_t taps, int64_t C,
                                     int64_t O, bool transposed, int64_t kp,
                                     int64_t n_pad,
                                     const ParallelFor& parallel_for,
                                     const int64_t* tap_of = nullptr) {
  std::unique_ptr<Buffer> b(new Buffer(n_pad * taps * kp));
  const auto sm =
      SignMatrix(w, taps, C, O, transposed, kp, n_pad, parallel_for, tap_of);
  PackShiftedB(sm->p, taps, kp, n_pad, b->p, parallel_for);
  return b;
}

// Rows [r0, r1) of a shifted GEMM's A over a grid into dst (row r0 first):
// each data pixel's `channels` values (times scale[c] if given) split into
// hi, mid and lo parts of kp values each (zero-padded), zeros for padding.
inline void FillSplitRange(const Grid& grid, const float* data,
                           const float* scale, int64_t channels, int64_t kp,
                           int64_t r0, int64_t r1, uint16_t* dst,
                           int parts = 3) {
  const int64_t ka = ARowStride(kp, parts);
  grid.Walk(r0, r1 - r0, /*data=*/true, [&](int64_t i, int64_t p) {
    uint16_t* row = dst + i * ka;
    if (p < 0) {
      std::fill(row, row + ka, uint16_t{0});
    } else {
      SplitRow(data + p * channels, scale, channels, kp, row, parts);
    }
  });
}

// ShiftedGemm::fill over a grid of `data` pixels.
inline std::function<void(int64_t, int64_t, uint16_t*)> SplitFill(
    const Grid& grid, const float* data, const float* scale, int64_t channels,
    int64_t kp, int parts = 3) {
  return [&grid, data, scale, channels, kp, parts](int64_t r0, int64_t r1,
                                                   uint16_t* dst) {
    FillSplitRange(grid, data, scale, channels, kp, r0, r1, dst, parts);
  };
}

// alpha (or ones) padded with ones to a multiple of 32.
inline std::vector<float> PaddedScale(const float* alpha, int64_t n) {
  std::vector<float> out(RoundUp(n, 32), 1.0f);
  if (alpha) std::copy(alpha, alpha + n, out.begin());
  return out;
}

// Writes row i of a finished 32 x 32 block (c as in BlockStore) to
// out[pixel[i] * ld + j] = c * scale[j], j < n, for each pixel[i] >= 0, or 0
// where clip_x is given and !(|clip_x[pixel * ld + j]| <= clip) (the
// ste_sign mask).
#if TAPEHOOK_HAVE_AMX_PATH
TAPEHOOK_AMX inline void StoreRowsAt(const int64_t* pixel,
                                     const float (*c)[256], const float* scale,
                                     int64_t n, float* out, int64_t ld,
                                     const float* clip_x = nullptr,
                                     float clip = 0) {
  const __mmask16 kl = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __mmask16 kr = n >= 32   ? __mmask16(0xFFFF)
                       : n <= 16 ? __mmask16(0)
                                 : __mmask16((1u << (n - 16)) - 1);
  const __m512 sl = _mm512_maskz_loadu_ps(kl, scale);
  const __m512 sr = _mm512_maskz_loadu_ps(kr, scale + 16);
  const __m512 lim = _mm512_set1_ps(clip);
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
inline void StoreRowsAt(const int64_t* pixel, const float (*c)[256],
                        const float* scale, int64_t n, float* out, int64_t ld,
                        const float* clip_x = nullptr, float clip = 0) {
  for (int64_t r = 0; r < 32; ++r) {
    const int64_t p = pixel[r];
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

// StoreRowsAt for the output pixels of grid rows q0 .. q0 + 31.
inline void StoreRows(const Grid& grid, int64_t q0, const float (*c)[256],
                      const float* scale, int64_t n, float* out, int64_t ld,
                      const float* clip_x = nullptr, float clip = 0) {
  int64_t pixel[32];
  grid.Walk(q0, 32, /*data=*/false,
            [&](int64_t i, int64_t p) { pixel[i] = p; });
  StoreRowsAt(pixel, c, scale, n, out, ld, clip_x, clip);
}

// ---------------------------------------------------------------------------
// Backprop filter: dW_t[c, o] = sum_q X[c, q + off[t]] * D[q, o], X being
// x_hat on the grid transposed (rows = channels), D being dy on the grid
// split into bf16 parts, each item's slice made by fill_d.
struct FilterGemm {
  const uint16_t* const* x_parts;  // [c_pad][qa] each
  int64_t qa;
  // fill_d(q0, q1, op, out): parts of dy at grid rows [q0, q1), channels
  // [32 op, 32 op + 32), pair-interleaved: out[i][(q - q0) / 2][32][2].
  std::function<void(int64_t, int64_t, int64_t, uint16_t* const*)> fill_d;
  int64_t q_len, kblock;
  const int64_t* off;
  // Tap t reads x_parts' rows from x_row[t] on (x has one block of c_pad
  // rows per phase of the conv, amx_conv.cc; one at stride 1).
  const int64_t* x_row = nullptr;
  int64_t taps, c_pairs, o_pairs;
  int64_t c_group;  // c pairs per item
  // Products kept: x part x_of[i] times dy part d_of[i], grouped by x part.
  const int* x_of;
  const int* d_of;
  int n_pairs;
  // Partial sums, [k block][tap][c pair][o pair][4][256] (fp32); with a
  // single k block, finish(unit, sums) takes each unit's sums instead.
  float* partial = nullptr;
  std::function<void(int64_t unit, const float* sums)> finish;
};

#if TAPEHOOK_HAVE_AMX_PATH
// Items [i0, i1): item i is (k block, o pair, group of c pairs), in that
// order of significance. An item reads one block of columns of x (its
// channels) and dy (32 channels), about 1 MiB that stays in L2 while it runs
// every tap and c pair of the group over it, so items can be sharded any way
// without re-reading memory.
TAPEHOOK_AMX inline void FilterGemmItems(const FilterGemm& g, int64_t i0,
                                         int64_t i1) {
  ConfigureTiles();
  const int64_t lda = g.qa * 2, ldb = 32 * 4;
  const int64_t units = g.taps * g.c_pairs * g.o_pairs;
  alignas(64) float sums[1024];
  const int64_t c_groups = (g.c_pairs + g.c_group - 1) / g.c_group;
  Buffer d_buf(3 * g.kblock * 32);
  uint16_t* const d_parts[3] = {d_buf.p, d_buf.p + g.kblock * 32,
                                d_buf.p + 2 * g.kblock * 32};
  int64_t filled = -1;  // the (k block, o pair) d_parts holds
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t cg = item % c_groups, rest = item / c_groups;
    const int64_t kb = rest / g.o_pairs, op = rest % g.o_pairs;
    const int64_t k0 = kb * g.kblock, k1 = std::min(g.q_len, k0 + g.kblock);
    if (rest != filled) {
      g.fill_d(k0, k1, op, d_parts);
      filled = rest;
    }
    const int64_t cp1 = std::min(g.c_pairs, (cg + 1) * g.c_group);
    for (int64_t t = 0; t < g.taps; ++t) {
      const int64_t row0 = g.x_row[t];
      for (int64_t cp = cg * g.c_group; cp < cp1; ++cp) {
        const int64_t c0 = row0 + cp * 32;
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
            const uint16_t* db = d_parts[g.d_of[i]] + (q0 - k0) / 2 * 64;
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

}  // namespace amx
}  // namespace tapehook

#endif  // TAPEHOOK_CORE_AMX_ENGINES_H_
