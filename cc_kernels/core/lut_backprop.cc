// Sign-table backprops on AVX-512 (see lut_backprop.h for the idea). Moved
// from the prototype in bench/lut_backprop/ (REPORT.md has its measurements
// and the reasons for the blocking below).
//
// Sign convention of every index: bit 1 <=> -1 (t < 0 or NaN), bit 0 <=> +1.
// The sign vectors S_i[j] = (j >> i) & 1 ? -1 : +1 make a table from four
// floats with one multiply and three FMAs: T = g0 S0 + g1 S1 + g2 S2 + g3 S3.
#include "lut_backprop.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "conv_util.h"
#include "cpu.h"
#include "lut_common.h"
#include "pack_input.h"
#include "simd_avx512.h"

namespace tapehook {
namespace lut {

bool Usable() { return TAPEHOOK_HAVE_AVX512_PATH && cpu::Avx512(); }

bool Supports(const ConvQuery& q) {
  // Unknown sizes (-1) do not exclude: the op checks again with all known.
  if (!TAPEHOOK_HAVE_AVX512_PATH || q.is_double) return false;
  if (q.dil_h != 1 || q.dil_w != 1) return false;
  switch (q.op) {
    case ConvOp::kForward:
      return false;
    case ConvOp::kBackpropInput:
      break;
    case ConvOp::kBackpropFilter:
      if (!q.binary_input) return false;
      break;
  }
  if (q.k_h > kMaxTaps || q.k_w > kMaxTaps) return false;
  return q.k_h < 0 || q.k_w < 0 || q.k_h * q.k_w <= kMaxTaps;
}

#if TAPEHOOK_HAVE_AVX512_PATH

namespace {

using lut_common::DwTaps;
using lut_common::kNegSigns;
using lut_common::PaddingCorrection;
using lut_common::Scratch;
using lut_common::TapsOf;

// ------------------------------------------------------------------ helpers

inline int64_t FloorDiv(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// The sign vectors as floats (initialized without AVX-512 instructions, so
// that loading the library runs none).
struct SignRows {
  alignas(64) float v[4][16];
  SignRows() {
    for (int i = 0; i < 4; ++i) {
      for (int j = 0; j < 16; ++j) v[i][j] = ((j >> i) & 1) ? -1.f : 1.f;
    }
  }
};
const SignRows kSignRows;

struct Signs {
  __m512 s[4];
};

TAPEHOOK_AVX512 inline Signs LoadSigns() {
  Signs S;
  for (int i = 0; i < 4; ++i) S.s[i] = _mm512_load_ps(kSignRows.v[i]);
  return S;
}

TAPEHOOK_AVX512 inline __m512 MakeTable(const Signs& S, float g0, float g1,
                                        float g2, float g3) {
  __m512 t = _mm512_mul_ps(_mm512_set1_ps(g0), S.s[0]);
  t = _mm512_fmadd_ps(_mm512_set1_ps(g1), S.s[1], t);
  t = _mm512_fmadd_ps(_mm512_set1_ps(g2), S.s[2], t);
  return _mm512_fmadd_ps(_mm512_set1_ps(g3), S.s[3], t);
}

// Channel blocks of 16 per microkernel call: 4 where they divide, else 2,
// else 1. Returns log2 of it.
inline int BlockLog2(int64_t blocks16) {
  return blocks16 % 4 == 0 ? 2 : blocks16 % 2 == 0 ? 1 : 0;
}

// Bytes of tables per dX job: L2-sized. These blocking constants were set by
// the prototype's sweeps (bench/lut_backprop/REPORT.md).
constexpr int64_t kTableBudget = 384 * 1024;
// Output-channel groups (of 4) per dX pass: more than an L1-sized pass.
constexpr int64_t kDxGroupsPerPass = 32;
// dW: position groups per K chunk (more than L1-sized) and output channels
// per slice.
constexpr int64_t kDwChunk = 192;
constexpr int64_t kDwSlice = 64;

// ======================================================================= dX

struct DxGeometry {
  int64_t n, h, w, ci, oh, ow, co, kh, kw, sh, sw, pt, pl;
  int64_t ci_pad;  // ci rounded up to 16 lanes
  int64_t cb;      // 16-lane input channel blocks
  int64_t cg;      // 4-channel output groups (co rounded up to 4)
  int64_t co16;    // 16-channel output blocks
  int64_t b;       // channel blocks per microkernel call
  int64_t ncbb;    // cb / b
  int lb;          // log2 b
  int p;           // positions per microkernel call
};

// idx layout: [tap][cb / b][cg][b][16] int32; lane = input channel
// (cbblk * b + bb) * 16 + lane, value = the 4 sign bits of
// w[tap, ci, 4 cg .. 4 cg + 3] (0 for channels past ci or co).

// masks[tap][co16][ci_pad]: 16 output channels' signs per input channel.
TAPEHOOK_AVX512 void DxSignMasks(const DxGeometry& g, const float* w,
                                 int64_t r0, int64_t r1, uint16_t* masks) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t tap = r / g.ci, c = r % g.ci;
    const float* row = w + r * g.co;
    for (int64_t j = 0; j < g.co16; ++j) {
      const __mmask16 k = simd::FirstLanes16(g.co - 16 * j);
      const __m512 v = _mm512_maskz_loadu_ps(k, row + 16 * j);
      masks[(tap * g.co16 + j) * g.ci_pad + c] =
          _mm512_mask_cmp_ps_mask(k, v, zero, _CMP_NGE_UQ);
    }
  }
}

// Rows r = tap * co16 + j of the index from the masks.
TAPEHOOK_AVX512 void DxIndexRows(const DxGeometry& g, const uint16_t* masks,
                                 int64_t r0, int64_t r1, int32_t* idx) {
  const __m512i nibble = _mm512_set1_epi32(15);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t tap = r / g.co16, j = r % g.co16;
    for (int64_t cb = 0; cb < g.cb; ++cb) {
      const __m512i m = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(masks + r * g.ci_pad + cb * 16)));
      const int64_t cbblk = cb / g.b, bb = cb % g.b;
      for (int q = 0; q < 4 && 4 * j + q < g.cg; ++q) {
        const int64_t cg = 4 * j + q;
        int32_t* dst =
            idx + (((tap * g.ncbb + cbblk) * g.cg + cg) * g.b + bb) * 16;
        _mm512_store_si512(
            dst, _mm512_and_si512(_mm512_srli_epi32(m, 4 * q), nibble));
      }
    }
  }
}

// P positions x B channel blocks; sums over ntaps taps x ncg table groups.
// Tables of tap t at base[p] - toff[t] + cg * 16, indices at tidx[t] +
// cg * B * 16, cg in [cg0, cg0 + ncg); accumulate: add to out, else store.
template <int P, int B>
TAPEHOOK_AVX512 void DxTile(const float* const* base, const int64_t* toff,
                            const int32_t* const* tidx, int ntaps, int64_t ncg,
                            float* const* out, int64_t cg0, bool accumulate) {
  __m512 acc[P][B];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      acc[p][b] =
          accumulate ? _mm512_loadu_ps(out[p] + b * 16) : _mm512_setzero_ps();
    }
  }
  for (int t = 0; t < ntaps; ++t) {
    const float* tp[P];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p) tp[p] = base[p] - toff[t] + cg0 * 16;
    const int32_t* ip = tidx[t] + cg0 * B * 16;
    for (int64_t cg = 0; cg < ncg; ++cg) {
      __m512i ix[B];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        ix[b] = _mm512_load_si512(ip + (cg * B + b) * 16);
      }
#pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const __m512 table = _mm512_load_ps(tp[p] + cg * 16);
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) {
          acc[p][b] =
              _mm512_add_ps(acc[p][b], _mm512_permutexvar_ps(ix[b], table));
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out[p] + b * 16, acc[p][b]);
  }
}

using DxTileFn = void (*)(const float* const*, const int64_t*,
                          const int32_t* const*, int, int64_t, float* const*,
                          int64_t, bool);

constexpr int kMaxP = 12;

template <int B, int... Ps>
void FillDxTiles(DxTileFn* table, std::integer_sequence<int, Ps...>) {
  ((table[Ps + 1] = &DxTile<Ps + 1, B>), ...);
}

// kDxTiles.k[log2 B][P]: 12 positions for B = 1, 2; 6 for B = 4 (24
// accumulators either way).
struct DxTiles {
  DxTileFn k[3][kMaxP + 1] = {};
  DxTiles() {
    FillDxTiles<1>(k[0], std::make_integer_sequence<int, 12>());
    FillDxTiles<2>(k[1], std::make_integer_sequence<int, 12>());
    FillDxTiles<4>(k[2], std::make_integer_sequence<int, 6>());
  }
};
const DxTiles kDxTiles;

// A job: images [n0, n1), input rows [r0, r1).
struct DxJob {
  int64_t n0, n1, r0, r1;
};

// Output rows [*lo, *hi] whose tables the input rows [r0, r1) need.
void DxTableRows(const DxGeometry& g, int64_t r0, int64_t r1, int64_t* lo,
                 int64_t* hi) {
  *lo = std::max<int64_t>(0, FloorDiv(r0 + g.pt - (g.kh - 1) + g.sh - 1, g.sh));
  *hi = std::min<int64_t>(g.oh - 1, FloorDiv(r1 - 1 + g.pt, g.sh));
}

// Jobs whose tables fit kTableBudget: whole images where one fits (and the
// batch leaves enough jobs), else bands of input rows. They depend only on
// the geometry, never on the thread pool.
std::vector<DxJob> DxJobs(const DxGeometry& g) {
  constexpr int64_t kMinJobs = 8;
  const int64_t row_bytes = g.ow * g.cg * 64;
  const int64_t img_bytes = row_bytes * g.oh;
  std::vector<DxJob> jobs;
  if (img_bytes <= kTableBudget && g.n >= kMinJobs / 2) {
    const int64_t per = std::clamp<int64_t>(
        kTableBudget / img_bytes, 1, std::max<int64_t>(1, g.n / kMinJobs));
    for (int64_t n = 0; n < g.n; n += per) {
      jobs.push_back({n, std::min(g.n, n + per), 0, g.h});
    }
    return jobs;
  }
  // Bands of equal height (in output rows), as many as the budget needs
  // and at least kMinJobs over the batch.
  const int64_t budget_rows =
      std::max<int64_t>(1, kTableBudget / row_bytes - (g.kh - 1) / g.sh - 1);
  const int64_t bands = std::max((g.oh + budget_rows - 1) / budget_rows,
                                 (kMinJobs + g.n - 1) / g.n);
  const int64_t rows_out = std::max<int64_t>(1, (g.oh + bands - 1) / bands);
  const int64_t band = rows_out * g.sh;
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t r = 0; r < g.h; r += band) {
      jobs.push_back({n, n + 1, r, std::min(g.h, r + band)});
    }
  }
  return jobs;
}

struct DxPos {
  int mask;      // bit a * kw + b: tap (a, b) reaches this input position
  int64_t base;  // the position's table base in the job's tables
  float* out;    // its ci_pad (or ci) outputs
};

// One job: tables alpha * dy for its output rows, positions grouped by tap
// mask, then the microkernels. dx rows go to `pad_out` (ci_pad per position)
// when ci is not a multiple of 16, and are copied out.
TAPEHOOK_AVX512 void DxRunJob(const DxGeometry& g, const DxJob& job,
                              const float* dy, const float* alpha,
                              const int32_t* idx, float* tab, float* pad_out,
                              std::vector<DxPos>* pos_buf, float* dx) {
  const Signs S = LoadSigns();
  int64_t lo, hi;
  DxTableRows(g, job.r0, job.r1, &lo, &hi);
  const int64_t rows = std::max<int64_t>(0, hi - lo + 1);
  const int64_t img_floats = rows * g.ow * g.cg * 16;
  const int64_t full = g.co / 4;  // groups of 4 real channels
  for (int64_t n = job.n0; n < job.n1; ++n) {
    for (int64_t o = lo; o <= hi; ++o) {
      for (int64_t x = 0; x < g.ow; ++x) {
        const float* d = dy + ((n * g.oh + o) * g.ow + x) * g.co;
        float* dst =
            tab + (n - job.n0) * img_floats + ((o - lo) * g.ow + x) * g.cg * 16;
        if (alpha != nullptr) {
          for (int64_t cg = 0; cg < full; ++cg) {
            const float* a = alpha + 4 * cg;
            const float* v = d + 4 * cg;
            _mm512_store_ps(dst + cg * 16,
                            MakeTable(S, v[0] * a[0], v[1] * a[1], v[2] * a[2],
                                      v[3] * a[3]));
          }
        } else {
          for (int64_t cg = 0; cg < full; ++cg) {
            const float* v = d + 4 * cg;
            _mm512_store_ps(dst + cg * 16,
                            MakeTable(S, v[0], v[1], v[2], v[3]));
          }
        }
        if (full < g.cg) {  // the last group, past co: zeros
          float v[4] = {0, 0, 0, 0};
          for (int64_t c = 4 * full; c < g.co; ++c) {
            v[c - 4 * full] = d[c] * (alpha != nullptr ? alpha[c] : 1.0f);
          }
          _mm512_store_ps(dst + full * 16,
                          MakeTable(S, v[0], v[1], v[2], v[3]));
        }
      }
    }
  }
  // Positions with their tap masks.
  std::vector<DxPos>& pos = *pos_buf;
  pos.clear();
  const int64_t job_rows = job.r1 - job.r0;
  for (int64_t n = job.n0; n < job.n1; ++n) {
    for (int64_t ih = job.r0; ih < job.r1; ++ih) {
      int mrow = 0;
      for (int64_t a = 0; a < g.kh; ++a) {
        const int64_t v = ih + g.pt - a;
        if (v >= 0 && v % g.sh == 0 && v / g.sh < g.oh) mrow |= 1 << a;
      }
      const int64_t rbase = FloorDiv(ih + g.pt, g.sh) - lo;
      for (int64_t iw = 0; iw < g.w; ++iw) {
        int mask = 0;
        for (int64_t b = 0; b < g.kw; ++b) {
          const int64_t v = iw + g.pl - b;
          if (v >= 0 && v % g.sw == 0 && v / g.sw < g.ow) {
            for (int64_t a = 0; a < g.kh; ++a) {
              if (mrow >> a & 1) mask |= 1 << (a * g.kw + b);
            }
          }
        }
        const int64_t base =
            (n - job.n0) * img_floats +
            (rbase * g.ow + FloorDiv(iw + g.pl, g.sw)) * g.cg * 16;
        float* out =
            pad_out != nullptr
                ? pad_out +
                      (((n - job.n0) * job_rows + ih - job.r0) * g.w + iw) *
                          g.ci_pad
                : dx + ((n * g.h + ih) * g.w + iw) * g.ci;
        pos.push_back({mask, base, out});
      }
    }
  }
  std::stable_sort(pos.begin(), pos.end(), [](const DxPos& a, const DxPos& b) {
    return a.mask < b.mask;
  });
  // Microkernels per mask group, in passes of kDxGroupsPerPass groups.
  int64_t toff[kMaxTaps + 1];
  const int32_t* tidx[kMaxTaps + 1];
  const float* bp[kMaxP];
  float* op[kMaxP];
  for (int64_t cg0 = 0; cg0 < g.cg; cg0 += kDxGroupsPerPass) {
    const int64_t ncg = std::min(kDxGroupsPerPass, g.cg - cg0);
    for (int64_t cbblk = 0; cbblk < g.ncbb; ++cbblk) {
      size_t g0 = 0;
      while (g0 < pos.size()) {
        size_t g1 = g0;
        while (g1 < pos.size() && pos[g1].mask == pos[g0].mask) ++g1;
        int nt = 0;
        for (int64_t a = 0; a < g.kh; ++a) {
          for (int64_t b = 0; b < g.kw; ++b) {
            if (pos[g0].mask >> (a * g.kw + b) & 1) {
              toff[nt] = ((a / g.sh) * g.ow + b / g.sw) * g.cg * 16;
              tidx[nt] =
                  idx + ((a * g.kw + b) * g.ncbb + cbblk) * g.cg * g.b * 16;
              ++nt;
            }
          }
        }
        for (size_t c = g0; c < g1; c += g.p) {
          const int np = static_cast<int>(std::min<size_t>(g.p, g1 - c));
          for (int p = 0; p < np; ++p) {
            bp[p] = tab + pos[c + p].base;
            op[p] = pos[c + p].out + cbblk * g.b * 16;
          }
          kDxTiles.k[g.lb][np](bp, toff, tidx, nt, ncg, op, cg0, cg0 > 0);
        }
        g0 = g1;
      }
    }
  }
  if (pad_out != nullptr) {
    for (int64_t n = job.n0; n < job.n1; ++n) {
      for (int64_t ih = job.r0; ih < job.r1; ++ih) {
        for (int64_t iw = 0; iw < g.w; ++iw) {
          const float* src =
              pad_out +
              (((n - job.n0) * job_rows + ih - job.r0) * g.w + iw) * g.ci_pad;
          std::memcpy(dx + ((n * g.h + ih) * g.w + iw) * g.ci, src,
                      sizeof(float) * g.ci);
        }
      }
    }
  }
}

// ======================================================================= dW

struct DwGeometry {
  int64_t n, h, w, ci, oh, ow, co, kh, kw, sh, sw, pt, pl;
  int64_t ci_pad, cb;  // as in DxGeometry
  int64_t ng;          // 4-column position groups per output row
  int64_t nih, niw;    // the nibble image's rows and columns
  int64_t b, ncbb, cmax;
  int lb;
};

// Signs of x, 16 channels to a uint16 (bit 1 <=> -1, 0 past ci): pixels
// [p0, p1) of a float x.
TAPEHOOK_AVX512 void SignsOfFloats(const float* x, int64_t ci, int64_t cb,
                                   int64_t p0, int64_t p1, uint16_t* bits) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    const float* xr = x + p * ci;
    for (int64_t j = 0; j < cb; ++j) {
      const __mmask16 k = simd::FirstLanes16(ci - 16 * j);
      const __m512 v = _mm512_maskz_loadu_ps(k, xr + 16 * j);
      bits[p * cb + j] = _mm512_mask_cmp_ps_mask(k, v, zero, _CMP_NGE_UQ);
    }
  }
}

// The same from the packed format.
void SignsOfPacked(const uint8_t* packed, int64_t ci, int64_t cb, int64_t p0,
                   int64_t p1, uint16_t* bits) {
  const int64_t row_bytes = PackedBytes(ci);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* r = packed + p * row_bytes;
    for (int64_t j = 0; j < cb; ++j) {
      unsigned m = 0;
      for (int64_t q = 0; q < 4 && 4 * j + q < row_bytes; ++q) {
        m |= unsigned{kNegSigns.v[r[4 * j + q]]} << (4 * q);
      }
      const int64_t valid = std::min<int64_t>(16, ci - 16 * j);
      if (valid < 16) m &= (1u << valid) - 1;
      bits[p * cb + j] = static_cast<uint16_t>(m);
    }
  }
}

// Nibble image NI[n][r][c][ci_pad] int32, r = ih + pt in [0, nih), c = iw +
// pl in [0, niw): bit i = sign bit of x(n, ih, iw + sw * i) (0, i.e. +1,
// outside the image). Rows nr = n * nih + r in [r0, r1).
TAPEHOOK_AVX512 void NibbleRows(const DwGeometry& g, const uint16_t* bits,
                                int64_t r0, int64_t r1, int32_t* ni) {
  for (int64_t nr = r0; nr < r1; ++nr) {
    const int64_t n = nr / g.nih, ih = nr % g.nih - g.pt;
    int32_t* row = ni + nr * g.niw * g.ci_pad;
    if (ih < 0 || ih >= g.h) {
      std::memset(row, 0, sizeof(int32_t) * g.niw * g.ci_pad);
      continue;
    }
    const uint16_t* xr = bits + (n * g.h + ih) * g.w * g.cb;
    for (int64_t c = 0; c < g.niw; ++c) {
      const int64_t iw0 = c - g.pl;
      for (int64_t j = 0; j < g.cb; ++j) {
        __m512i v = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) {
          const int64_t iw = iw0 + g.sw * i;
          if (iw < 0 || iw >= g.w) continue;
          v = _mm512_mask_or_epi32(v, xr[iw * g.cb + j], v,
                                   _mm512_set1_epi32(1 << i));
        }
        _mm512_store_si512(row + c * g.ci_pad + j * 16, v);
      }
    }
  }
}

// B channel blocks x C output channels, over ngroups position groups.
// acc layout [co][ci_pad] (ci contiguous), acc_stride floats per co.
template <int B, int C>
TAPEHOOK_AVX512 void DwTile(const int32_t* ni, const int64_t* goff,
                            int64_t tapoff, const float* tab,
                            int64_t tab_stride, int64_t ngroups, float* acc_out,
                            int64_t acc_stride) {
  __m512 acc[B][C];
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
#pragma GCC unroll 24
    for (int c = 0; c < C; ++c) {
      acc[b][c] = _mm512_load_ps(acc_out + c * acc_stride + b * 16);
    }
  }
  for (int64_t gi = 0; gi < ngroups; ++gi) {
    const int32_t* ip = ni + goff[gi] + tapoff;
    const float* tp = tab + gi * tab_stride;
    __m512i ix[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) ix[b] = _mm512_load_si512(ip + b * 16);
#pragma GCC unroll 24
    for (int c = 0; c < C; ++c) {
      const __m512 table = _mm512_load_ps(tp + c * 16);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        acc[b][c] =
            _mm512_add_ps(acc[b][c], _mm512_permutexvar_ps(ix[b], table));
      }
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
#pragma GCC unroll 24
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(acc_out + c * acc_stride + b * 16, acc[b][c]);
    }
  }
}

using DwTileFn = void (*)(const int32_t*, const int64_t*, int64_t, const float*,
                          int64_t, int64_t, float*, int64_t);

constexpr int kMaxC = 12;

template <int B, int... Cs>
void FillDwTiles(DwTileFn* table, std::integer_sequence<int, Cs...>) {
  ((table[Cs + 1] = &DwTile<B, Cs + 1>), ...);
}

// kDwTiles.k[log2 B][C]: 12 output channels for B = 1, 2; 6 for B = 4.
struct DwTiles {
  DwTileFn k[3][kMaxC + 1] = {};
  DwTiles() {
    FillDwTiles<1>(k[0], std::make_integer_sequence<int, 12>());
    FillDwTiles<2>(k[1], std::make_integer_sequence<int, 12>());
    FillDwTiles<4>(k[2], std::make_integer_sequence<int, 6>());
  }
};
const DwTiles kDwTiles;

// Index vectors of an in-register 16x16 transpose (4 rounds of
// permutex2var).
struct TransposeIdx {
  alignas(64) int32_t lo[4][16];
  alignas(64) int32_t hi[4][16];
  TransposeIdx() {
    for (int q = 0; q < 4; ++q) {
      for (int j = 0; j < 16; ++j) {
        const int d = 1 << q;
        lo[q][j] = (j & d) ? 16 + j - d : j;
        hi[q][j] = (j & d) ? 16 + j : j + d;
      }
    }
  }
};
const TransposeIdx kTransposeIdx;

TAPEHOOK_AVX512 inline void Transpose16(__m512 r[16]) {
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    const int d = 1 << q;
    const __m512i il = _mm512_load_si512(kTransposeIdx.lo[q]);
    const __m512i ih = _mm512_load_si512(kTransposeIdx.hi[q]);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (!(i & d)) {
        const __m512 a = r[i], b = r[i + d];
        r[i] = _mm512_permutex2var_ps(a, il, b);
        r[i + d] = _mm512_permutex2var_ps(a, ih, b);
      }
    }
  }
}

// dW columns [co_begin, co_end), in slices of up to kDwSlice channels: per
// slice, acc[tap][cs_pad][ci_pad] over K chunks of position groups, then the
// padding correction and the transpose into HWIO.
TAPEHOOK_AVX512 void DwColumns(const DwGeometry& g, const DwTaps& taps,
                               const int32_t* ni, const float* dy,
                               int64_t co_begin, int64_t co_end, float* dw) {
  const Signs S = LoadSigns();
  const int64_t ntaps = g.kh * g.kw;
  const int64_t total_groups = g.n * g.oh * g.ng;
  const int64_t ni_img = g.nih * g.niw * g.ci_pad;
  Scratch<float> tab(kDwChunk * kDwSlice * 16);
  Scratch<float> acc(ntaps * kDwSlice * g.ci_pad);
  std::vector<int64_t> goff(kDwChunk);
  std::vector<float> corr(ntaps * kDwSlice);
  std::vector<float> border_sum(taps.border.size() * kDwSlice);
  for (int64_t cs0 = co_begin; cs0 < co_end; cs0 += kDwSlice) {
    const int64_t csn = std::min(kDwSlice, co_end - cs0);
    const int64_t cs_pad = RoundUp(csn, 16);
    std::memset(acc.get(), 0, sizeof(float) * ntaps * cs_pad * g.ci_pad);
    for (int64_t k0 = 0; k0 < total_groups; k0 += kDwChunk) {
      const int64_t kc = std::min(kDwChunk, total_groups - k0);
      // Tables [group][co in slice][16] and the groups' nibble offsets.
      for (int64_t gi = 0; gi < kc; ++gi) {
        const int64_t gg = k0 + gi;
        const int64_t n = gg / (g.oh * g.ng);
        const int64_t o = gg / g.ng % g.oh, x0 = gg % g.ng * 4;
        goff[gi] = n * ni_img + (o * g.sh * g.niw + x0 * g.sw) * g.ci_pad;
        const float* d = dy + ((n * g.oh + o) * g.ow + x0) * g.co + cs0;
        float* dst = tab.get() + gi * csn * 16;
        const int64_t valid = std::min<int64_t>(4, g.ow - x0);
        if (valid == 4) {
          for (int64_t c = 0; c < csn; ++c) {
            _mm512_store_ps(dst + c * 16,
                            MakeTable(S, d[c], d[c + g.co], d[c + 2 * g.co],
                                      d[c + 3 * g.co]));
          }
        } else {
          for (int64_t c = 0; c < csn; ++c) {
            float v[4] = {0, 0, 0, 0};
            for (int64_t i = 0; i < valid; ++i) v[i] = d[c + i * g.co];
            _mm512_store_ps(dst + c * 16, MakeTable(S, v[0], v[1], v[2], v[3]));
          }
        }
      }
      for (int64_t c0 = 0; c0 < csn; c0 += g.cmax) {
        const int64_t nc = std::min(g.cmax, csn - c0);
        for (int64_t tap = 0; tap < ntaps; ++tap) {
          if (!taps.live[tap]) continue;
          const int64_t tapoff = (tap / g.kw * g.niw + tap % g.kw) * g.ci_pad;
          for (int64_t cbblk = 0; cbblk < g.ncbb; ++cbblk) {
            kDwTiles.k[g.lb][nc](
                ni + cbblk * g.b * 16, goff.data(), tapoff, tab.get() + c0 * 16,
                csn * 16, kc,
                acc.get() + (tap * cs_pad + c0) * g.ci_pad + cbblk * g.b * 16,
                g.ci_pad);
          }
        }
      }
    }
    // Zero padding: the kernel counted padded taps as +1; subtract
    // corr[tap][co] = the sum of dy over the positions where tap is padding.
    PaddingCorrection(g, taps, dy, cs0, csn, kDwSlice, &border_sum, &corr);
    // acc [tap][co][ci] -> dw [tap][ci][co] minus corr; taps that never
    // meet the input are exact zeros.
    for (int64_t tap = 0; tap < ntaps; ++tap) {
      if (!taps.live[tap]) {
        for (int64_t i = 0; i < g.ci; ++i) {
          std::fill_n(dw + (tap * g.ci + i) * g.co + cs0, csn, 0.0f);
        }
        continue;
      }
      for (int64_t c0 = 0; c0 < cs_pad; c0 += 16) {
        const __mmask16 k = simd::FirstLanes16(csn - c0);
        const __m512 cv =
            _mm512_maskz_loadu_ps(k, corr.data() + tap * kDwSlice + c0);
        for (int64_t i0 = 0; i0 < g.ci_pad; i0 += 16) {
          __m512 r[16];
          for (int j = 0; j < 16; ++j) {
            r[j] = _mm512_load_ps(acc.get() +
                                  (tap * cs_pad + c0 + j) * g.ci_pad + i0);
          }
          Transpose16(r);
          const int64_t rows = std::min<int64_t>(16, g.ci - i0);
          for (int64_t j = 0; j < rows; ++j) {
            _mm512_mask_storeu_ps(dw + (tap * g.ci + i0 + j) * g.co + cs0 + c0,
                                  k, _mm512_sub_ps(r[j], cv));
          }
        }
      }
    }
  }
}

// dW from the sign bits of x ([pixel][cb] uint16).
void FilterFromSigns(const DwGeometry& g, const uint16_t* bits, const float* dy,
                     float* dw, const ParallelFor& parallel_for) {
  Scratch<int32_t> ni(g.n * g.nih * g.niw * g.ci_pad);
  parallel_for(g.n * g.nih, g.niw * g.ci_pad * 4, [&](int64_t r0, int64_t r1) {
    NibbleRows(g, bits, r0, r1, ni.get());
  });
  const DwTaps taps = TapsOf(g);
  const int64_t units = (g.co + 15) / 16;
  const int64_t cost = g.n * g.oh * g.ow * g.kh * g.kw * g.ci_pad * 4;
  parallel_for(units, cost, [&](int64_t u0, int64_t u1) {
    DwColumns(g, taps, ni.get(), dy, 16 * u0, std::min(g.co, 16 * u1), dw);
  });
}

DwGeometry DwGeometryOf(const ConvShape& s) {
  DwGeometry g;
  g.n = s.batch, g.h = s.in_h, g.w = s.in_w, g.ci = s.in_c;
  g.oh = s.out_h, g.ow = s.out_w, g.co = s.out_c, g.kh = s.k_h, g.kw = s.k_w;
  g.sh = s.stride_h, g.sw = s.stride_w, g.pt = s.pad_top, g.pl = s.pad_left;
  g.ci_pad = RoundUp(g.ci, 16);
  g.cb = g.ci_pad / 16;
  g.ng = (g.ow + 3) / 4;
  g.nih = (g.oh - 1) * g.sh + g.kh;
  g.niw = 4 * (g.ng - 1) * g.sw + g.kw;
  g.lb = BlockLog2(g.cb);
  g.b = int64_t{1} << g.lb;
  g.ncbb = g.cb / g.b;
  g.cmax = g.b == 4 ? 6 : 12;
  return g;
}

// Whether the engines run this conv now (with every size known).
bool Runs(ConvOp op, const ConvShape& s) {
  return Usable() && Supports(QueryOf(op, s, true, false, false)) &&
         s.batch > 0 && s.in_h > 0 && s.in_w > 0 && s.in_c > 0 && s.out_c > 0 &&
         s.out_h > 0 && s.out_w > 0;
}

}  // namespace

bool BackpropInput(const ConvShape& s, const float* w, const float* alpha,
                   const float* dy, float* dx,
                   const ParallelFor& parallel_for) {
  if (!Runs(ConvOp::kBackpropInput, s)) return false;
  DxGeometry g;
  g.n = s.batch, g.h = s.in_h, g.w = s.in_w, g.ci = s.in_c;
  g.oh = s.out_h, g.ow = s.out_w, g.co = s.out_c, g.kh = s.k_h, g.kw = s.k_w;
  g.sh = s.stride_h, g.sw = s.stride_w, g.pt = s.pad_top, g.pl = s.pad_left;
  g.ci_pad = RoundUp(g.ci, 16);
  g.cb = g.ci_pad / 16;
  g.cg = (g.co + 3) / 4;
  g.co16 = (g.co + 15) / 16;
  g.lb = BlockLog2(g.cb);
  g.b = int64_t{1} << g.lb;
  g.ncbb = g.cb / g.b;
  g.p = g.b == 4 ? 6 : 12;
  const int64_t taps = g.kh * g.kw;

  // The index from W's signs, in two parallel passes.
  std::vector<uint16_t> masks(taps * g.co16 * g.ci_pad, 0);
  parallel_for(taps * g.ci, g.co, [&](int64_t r0, int64_t r1) {
    DxSignMasks(g, w, r0, r1, masks.data());
  });
  Scratch<int32_t> idx(taps * g.ncbb * g.cg * g.b * 16);
  parallel_for(taps * g.co16, g.ci_pad * 4, [&](int64_t r0, int64_t r1) {
    DxIndexRows(g, masks.data(), r0, r1, idx.get());
  });

  const std::vector<DxJob> jobs = DxJobs(g);
  int64_t max_tab = 0, max_out = 0;
  for (const DxJob& j : jobs) {
    int64_t lo, hi;
    DxTableRows(g, j.r0, j.r1, &lo, &hi);
    max_tab =
        std::max(max_tab, (j.n1 - j.n0) * std::max<int64_t>(0, hi - lo + 1) *
                              g.ow * g.cg * 16);
    max_out = std::max(max_out, (j.n1 - j.n0) * (j.r1 - j.r0) * g.w * g.ci_pad);
  }
  const bool pad = g.ci_pad != g.ci;
  const int64_t cost = g.n * g.h * g.w * taps * g.ci_pad * g.cg /
                       static_cast<int64_t>(jobs.size());
  parallel_for(static_cast<int64_t>(jobs.size()), cost,
               [&](int64_t j0, int64_t j1) {
                 Scratch<float> tab(max_tab + 16);
                 Scratch<float> pad_out(pad ? max_out : 1);
                 std::vector<DxPos> pos;
                 for (int64_t j = j0; j < j1; ++j) {
                   DxRunJob(g, jobs[j], dy, alpha, idx.get(), tab.get(),
                            pad ? pad_out.get() : nullptr, &pos, dx);
                 }
               });
  return true;
}

bool BackpropFilter(const ConvShape& s, const float* x, const float* dy,
                    float* dw, const ParallelFor& parallel_for) {
  if (!Runs(ConvOp::kBackpropFilter, s)) return false;
  const DwGeometry g = DwGeometryOf(s);
  const int64_t pixels = g.n * g.h * g.w;
  Scratch<uint16_t> bits(pixels * g.cb);
  parallel_for(pixels, g.ci, [&](int64_t p0, int64_t p1) {
    SignsOfFloats(x, g.ci, g.cb, p0, p1, bits.get());
  });
  FilterFromSigns(g, bits.get(), dy, dw, parallel_for);
  return true;
}

bool BackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                          const float* dy, float* dw,
                          const ParallelFor& parallel_for) {
  if (!Runs(ConvOp::kBackpropFilter, s)) return false;
  const DwGeometry g = DwGeometryOf(s);
  const int64_t pixels = g.n * g.h * g.w;
  Scratch<uint16_t> bits(pixels * g.cb);
  parallel_for(pixels, g.ci, [&](int64_t p0, int64_t p1) {
    SignsOfPacked(packed, g.ci, g.cb, p0, p1, bits.get());
  });
  FilterFromSigns(g, bits.get(), dy, dw, parallel_for);
  return true;
}

#else  // !TAPEHOOK_HAVE_AVX512_PATH

bool BackpropInput(const ConvShape&, const float*, const float*, const float*,
                   float*, const ParallelFor&) {
  return false;
}
bool BackpropFilter(const ConvShape&, const float*, const float*, float*,
                    const ParallelFor&) {
  return false;
}
bool BackpropFilterPacked(const ConvShape&, const uint8_t*, const float*,
                          float*, const ParallelFor&) {
  return false;
}

#endif  // TAPEHOOK_HAVE_AVX512_PATH

}  // namespace lut
}  // namespace tapehook
