// AMX kernels for the float-operand binary convolutions (see amx_conv.h for
// the bf16 split that keeps them exact).
//
// Layout. A stride-1 convolution reads, for output pixel (n, oh, ow) and tap
// (kh, kw), the padded input pixel (n, oh + kh * dil_h, ow + kw * dil_w).
// Flatten each padded image row-major into one "q grid" (plane = hp * wp
// rows per image) and put output pixel (n, oh, ow) at q = n * plane +
// oh * wp + ow: then tap t reads grid row q + off[t], off[t] = kh * dil_h *
// wp + kw * dil_w, for every output pixel alike. A tile of 16 consecutive q
// is then a 16-row strided block of the padded input, which is exactly what
// an AMX tile load reads, so the convolution is a GEMM over shifted row
// blocks with no im2col copy. Grid positions that are not output pixels
// (ow >= out_w, oh >= out_h) are computed and dropped.
//
// Strided backprops run by phases (PhasesOf): with stride S, tap kh reads
// input row S * oh + kh * dil - pad = S * (oh + d) + p, 0 <= p < S. The
// input pixels of one phase (p_h, p_w), rows S * a + p_h and columns
// S * b + p_w, form an image of ceil(in / S) pixels a side that each tap of
// that phase reads at a fixed shift (d_h, d_w) from the output pixel: a
// stride-1 problem again. dW: x's phases side by side on one grid, tap t
// reading its phase's rows (FilterGemm::x_row) at its shift. dX: one
// shifted GEMM over dy whose output columns are (phase, channel), each
// phase with its own taps (ShiftedGemm::phase_taps), storing into the
// phase's pixels of dx. Either does the stride-1 kernels' work per
// multiply-add, none on taps that read nothing.
#include "amx_conv.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "amx_engines.h"
#include "amx_grid.h"
#include "amx_primitives.h"
#include "amx_runtime.h"
#include "cpu.h"
#include "pack_input.h"
#include "plan.h"

namespace tapehook {
namespace amx {

bool Usable() { return TAPEHOOK_HAVE_AMX_PATH && cpu::Amx(); }

bool Supports(const ConvQuery& q) {
  // Unknown sizes (-1) do not exclude: the op checks again with all known.
  auto nonzero = [](int64_t v) { return v != 0; };
  const bool strided = q.stride_h != 1 || q.stride_w != 1;
  if (!TAPEHOOK_HAVE_AMX_PATH || q.stride_h < 1 || q.stride_w < 1 ||
      (strided && q.op == ConvOp::kForward)) {
    return false;  // a strided forward: not written (the backprops are)
  }
  for (int64_t v : {q.batch, q.in_h, q.in_w, q.in_c, q.out_c, q.out_h, q.out_w,
                    q.k_h, q.k_w}) {
    if (!nonzero(v)) return false;
  }
  if (q.op != ConvOp::kBackpropInput && !strided) return true;
  // dx is a forward conv of dy padded by (k - 1) * dil - pad >= 0; the
  // phases of a strided conv need the same.
  auto fits = [](int64_t pad, int64_t k, int64_t dil) {
    return pad < 0 || (k >= 1 && pad <= (k - 1) * dil);
  };
  return fits(q.pad_top, q.k_h, q.dil_h) && fits(q.pad_left, q.k_w, q.dil_w);
}

bool SupportsForward(const ConvShape& s) {
  return Supports(QueryOf(ConvOp::kForward, s, false, false, false));
}

bool SupportsBackpropInput(const ConvShape& s) {
  return Supports(QueryOf(ConvOp::kBackpropInput, s, false, false, false));
}

bool SupportsBackpropFilter(const ConvShape& s) {
  return Supports(QueryOf(ConvOp::kBackpropFilter, s, false, false, false));
}

struct ForwardFilter {
  int64_t k_h = 0, k_w = 0, in_c = 0, out_c = 0;
  std::unique_ptr<Buffer> b;  // sign(W) as the shifted GEMM's B
  std::vector<float> scale;   // alpha (or ones), PaddedScale
};

std::shared_ptr<const ForwardFilter> PackForwardFilter(
    const ConvShape& s, const float* w, const float* alpha,
    const ParallelFor& parallel_for) {
  if (!SupportsForward(s) || !Usable()) return nullptr;
  const int64_t C = s.in_c, O = s.out_c, taps = s.k_h * s.k_w;
  auto f = std::make_shared<ForwardFilter>();
  f->k_h = s.k_h, f->k_w = s.k_w, f->in_c = C, f->out_c = O;
  f->b = SignB(w, taps, C, O, /*transposed=*/false, RoundUp(C, 32),
               (O + 31) / 32 * 32, parallel_for);
  f->scale = PaddedScale(alpha, O);
  return f;
}

bool ForwardFilterFits(const ForwardFilter& f, const ConvShape& s) {
  return f.k_h == s.k_h && f.k_w == s.k_w && f.in_c == s.in_c &&
         f.out_c == s.out_c;
}

bool ForwardWith(const ConvShape& s, const float* x, const ForwardFilter& f,
                 float* y, const ParallelFor& parallel_for) {
  if (!SupportsForward(s) || !Usable() || !ForwardFilterFits(f, s)) {
    return false;
  }
  const int64_t C = s.in_c, O = s.out_c, taps = s.k_h * s.k_w;
  const Grid grid = InputGrid(s);
  const Taps tp = TapOffsets(s, grid.wp);
  const int64_t kp = RoundUp(C, 32);
  const int64_t q_pairs = (grid.q_end() + 31) / 32;
  const int64_t rows = q_pairs * 32 + tp.max_off;
  const int64_t o_pairs = (O + 31) / 32;
  ShiftedGemm g;
  g.kp = kp;
  g.off = tp.off.data();
  g.taps = taps;
  g.b = f.b->p;
  g.o_pairs = o_pairs;
  g.q_pairs = q_pairs;
  g.o_group = OGroup(o_pairs, taps, kp);
  g.fill = SplitFill(grid, x, nullptr, C, kp);
  g.rows = rows;
  g.max_off = tp.max_off;
  RunShiftedGemm(
      g,
      [&](int64_t q0, int64_t o0, const float (*c)[256]) {
        StoreRows(grid, q0, c, f.scale.data() + o0,
                  std::min<int64_t>(32, O - o0), y + o0, O);
      },
      parallel_for);
  return true;
}

bool Forward(const ConvShape& s, const float* x, const float* w,
             const float* alpha, float* y, const ParallelFor& parallel_for) {
  const std::shared_ptr<const ForwardFilter> f =
      PackForwardFilter(s, w, alpha, parallel_for);
  return f != nullptr && ForwardWith(s, x, *f, y, parallel_for);
}

namespace {

int64_t FloorDiv(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// A conv's taps by phase (file comment): tap t = kh * k_w + kw reads phase
// phase[t] = p_h * stride_w + p_w of the input at shift (dh[t], dw[t])
// from the output pixel. Stride 1: one phase, the input itself.
struct Phases {
  int64_t s_h, s_w;  // the strides
  int64_t a_h, a_w;  // a phase's image: ceil(in / stride) a side
  int64_t in_h, in_w;
  std::vector<int64_t> phase, dh, dw;
  int64_t dmin_h = 0, dmax_h = 0, dmin_w = 0, dmax_w = 0;
  int64_t count() const { return s_h * s_w; }
  // The input pixel of phase f's pixel (n, a, b), or -1 for none (n < 0)
  // or past the input's edge.
  int64_t Full(int64_t f, int64_t n, int64_t a, int64_t b) const {
    const int64_t y = a * s_h + f / s_w, x = b * s_w + f % s_w;
    return n >= 0 && y < in_h && x < in_w ? (n * in_h + y) * in_w + x : -1;
  }
};

Phases PhasesOf(const ConvShape& s) {
  Phases ph;
  ph.s_h = s.stride_h, ph.s_w = s.stride_w;
  ph.a_h = (s.in_h + s.stride_h - 1) / s.stride_h;
  ph.a_w = (s.in_w + s.stride_w - 1) / s.stride_w;
  ph.in_h = s.in_h, ph.in_w = s.in_w;
  for (int64_t kh = 0; kh < s.k_h; ++kh) {
    for (int64_t kw = 0; kw < s.k_w; ++kw) {
      const int64_t rh = kh * s.dil_h - s.pad_top,
                    rw = kw * s.dil_w - s.pad_left;
      const int64_t dh = FloorDiv(rh, s.stride_h),
                    dw = FloorDiv(rw, s.stride_w);
      ph.phase.push_back((rh - dh * s.stride_h) * s.stride_w +
                         (rw - dw * s.stride_w));
      ph.dh.push_back(dh);
      ph.dw.push_back(dw);
    }
  }
  ph.dmin_h = *std::min_element(ph.dh.begin(), ph.dh.end());
  ph.dmax_h = *std::max_element(ph.dh.begin(), ph.dh.end());
  ph.dmin_w = *std::min_element(ph.dw.begin(), ph.dw.end());
  ph.dmax_w = *std::max_element(ph.dw.begin(), ph.dw.end());
  return ph;
}

// Stores one finished 32 x 32 block of dx (rows: the dx pixels pixel[i], -1
// for none; channels c0 ..) as BackpropInputImpl describes.
void StoreDx(const int64_t* pixel, int64_t c0, const float (*acc)[256],
             const ConvShape& s, const float* x, const uint8_t* packed,
             Estimator act_est, double clip, float* dx) {
  static const std::vector<float> ones(32, 1.0f);
  const int64_t C = s.in_c;
  const int64_t c_n = std::min<int64_t>(32, C - c0);
  if (packed != nullptr) {  // store and mask in one pass
    for (int64_t r = 0; r < 32; ++r) {
      const int64_t p = pixel[r];
      if (p < 0) continue;
      StoreMaskedRow(acc[(r / 16) * 2] + (r % 16) * 16,
                     acc[(r / 16) * 2 + 1] + (r % 16) * 16, c_n,
                     packed + p * PackedBytes(C) + c0 / 4, dx + p * C + c0);
    }
    return;
  }
  if (act_est == Estimator::kNone || act_est == Estimator::kSteSign) {
    StoreRowsAt(pixel, acc, ones.data(), c_n, dx + c0, C,
                act_est == Estimator::kSteSign ? x + c0 : nullptr,
                static_cast<float>(clip));
    return;
  }
  StoreRowsAt(pixel, acc, ones.data(), c_n, dx + c0, C);
  for (int64_t r = 0; r < 32; ++r) {
    const int64_t p = pixel[r];
    if (p < 0) continue;
    float* out = dx + p * C + c0;
    const float* xr = x + p * C + c0;
    if (act_est == Estimator::kApproxSign) {  // vectorized
      for (int64_t j = 0; j < c_n; ++j) out[j] *= ApproxSignGrad(xr[j]);
      continue;
    }
    for (int64_t j = 0; j < c_n; ++j) out[j] *= ActGrad(act_est, xr[j], clip);
  }
}

// A strided conv's dx by phases (file comment): phase f's pixel (n, a, b)
// sums dy pixel (n, a - dh[t], b - dw[t]) times W_t^T over f's taps t, a
// stride-1 shifted GEMM over dy padded by dmax. All phases run as one GEMM
// whose output columns are (phase, channel) and whose taps differ by phase
// (ShiftedGemm::phase_taps), so each thread splits a window of dy once for
// all of them; a phase no tap reads sums nothing and stores zeros.
void BackpropInputStrided(const ConvShape& s, const float* x,
                          const uint8_t* packed, const float* w,
                          const float* dy, Estimator act_est, double clip,
                          const float* alpha, float* dx,
                          const ParallelFor& parallel_for, DySplit dy_split) {
  const int64_t C = s.in_c, O = s.out_c;
  const Phases ph = PhasesOf(s);
  const Grid grid =
      PaddedGrid(s.batch, ph.dmax_h, ph.dmax_w, s.out_h, s.out_w, ph.a_h,
                 ph.a_w, ph.dmax_h - ph.dmin_h, ph.dmax_w - ph.dmin_w);
  const int64_t kp = RoundUp(O, 32);
  const int64_t q_pairs = (grid.q_end() + 31) / 32;
  const int64_t c_pairs = (C + 31) / 32;
  const std::vector<float> scale = PaddedScale(alpha, O);
  const int64_t n_phases = ph.count();
  std::vector<std::vector<int64_t>> taps(n_phases), off(n_phases);
  int64_t max_taps = 1, max_off = 0;
  for (int64_t t = 0; t < static_cast<int64_t>(ph.phase.size()); ++t) {
    const int64_t f = ph.phase[t];
    taps[f].push_back(t);
    off[f].push_back((ph.dmax_h - ph.dh[t]) * grid.wp + ph.dmax_w - ph.dw[t]);
    max_taps = std::max<int64_t>(max_taps, taps[f].size());
    max_off = std::max(max_off, off[f].back());
  }
  ShiftedGemm g;
  std::vector<std::unique_ptr<Buffer>> bs;
  for (int64_t f = 0; f < n_phases; ++f) {
    const int64_t n = static_cast<int64_t>(taps[f].size());
    bs.push_back(n == 0 ? nullptr
                        : SignB(w, n, C, O, /*transposed=*/true, kp,
                                c_pairs * 32, parallel_for, taps[f].data()));
    g.phase_taps.push_back(n);
    g.phase_off.push_back(off[f].data());
    g.phase_b.push_back(n == 0 ? nullptr : bs.back()->p);
  }
  g.kp = kp;
  g.phase_pairs = c_pairs;
  g.off = nullptr;
  g.taps = max_taps;
  g.b = nullptr;
  g.o_pairs = n_phases * c_pairs;  // columns: (phase, dx channel)
  g.q_pairs = q_pairs;
  g.o_group = OGroup(g.o_pairs, max_taps, kp);
  g.parts = static_cast<int>(dy_split);
  g.fill = SplitFill(grid, dy, alpha ? scale.data() : nullptr, O, kp, g.parts);
  g.rows = q_pairs * 32 + max_off;
  g.max_off = max_off;
  RunShiftedGemm(
      g,
      [&](int64_t q0, int64_t o0, const float (*acc)[256]) {
        const int64_t f = o0 / (c_pairs * 32), c0 = o0 % (c_pairs * 32);
        int64_t pixel[32];
        grid.WalkCoords(q0, 32, /*data=*/false,
                        [&](int64_t i, int64_t n, int64_t a, int64_t b) {
                          pixel[i] = ph.Full(f, n, a, b);
                        });
        StoreDx(pixel, c0, acc, s, x, packed, act_est, clip, dx);
      },
      parallel_for);
}

// The input comes either as floats (x) or as packed sign / mask bits
// (packed, pack_input.h, with the ste_sign estimator); exactly one is set.
bool BackpropInputImpl(const ConvShape& s, const float* x,
                       const uint8_t* packed, const float* w, const float* dy,
                       Estimator act_est, double clip, const float* alpha,
                       float* dx, const ParallelFor& parallel_for,
                       DySplit dy_split) {
  if (!SupportsBackpropInput(s) || !Usable()) return false;
  if (s.stride_h != 1 || s.stride_w != 1) {
    BackpropInputStrided(s, x, packed, w, dy, act_est, clip, alpha, dx,
                         parallel_for, dy_split);
    return true;
  }
  const int64_t C = s.in_c, O = s.out_c, taps = s.k_h * s.k_w;
  const int64_t eh = (s.k_h - 1) * s.dil_h, ew = (s.k_w - 1) * s.dil_w;
  // dx = conv2d(dy padded by (eh - pad_top, ew - pad_left), flipped W^T).
  const Grid grid = PaddedGrid(s.batch, eh - s.pad_top, ew - s.pad_left,
                               s.out_h, s.out_w, s.in_h, s.in_w, eh, ew);
  const Taps tp = TapOffsets(s, grid.wp);
  const int64_t kp = RoundUp(O, 32);
  const int64_t q_pairs = (grid.q_end() + 31) / 32;
  const int64_t rows = q_pairs * 32 + tp.max_off;
  const int64_t c_pairs = (C + 31) / 32;

  const std::vector<float> scale = PaddedScale(alpha, O);

  const auto b =
      SignB(w, taps, C, O, /*transposed=*/true, kp, c_pairs * 32, parallel_for);

  ShiftedGemm g;
  g.kp = kp;
  g.off = tp.off.data();
  g.taps = taps;
  g.b = b->p;
  g.o_pairs = c_pairs;  // the GEMM's output columns are dx's channels
  g.q_pairs = q_pairs;
  g.o_group = OGroup(c_pairs, taps, kp);
  g.parts = static_cast<int>(dy_split);
  g.fill = SplitFill(grid, dy, alpha ? scale.data() : nullptr, O, kp, g.parts);
  g.rows = rows;
  g.max_off = tp.max_off;
  RunShiftedGemm(
      g,
      [&](int64_t q0, int64_t c0, const float (*acc)[256]) {
        int64_t pixel[32];
        grid.Walk(q0, 32, /*data=*/false,
                  [&](int64_t i, int64_t p) { pixel[i] = p; });
        StoreDx(pixel, c0, acc, s, x, packed, act_est, clip, dx);
      },
      parallel_for);
  return true;
}

bool BackpropFilterImpl(const ConvShape& s, const float* x,
                        const uint8_t* packed, const float* w, const float* dy,
                        Estimator act_est, Estimator w_est, double clip,
                        const float* alpha, float* dw,
                        const ParallelFor& parallel_for, DySplit dy_split) {
  if (!SupportsBackpropFilter(s) || !Usable()) return false;
#if TAPEHOOK_HAVE_AMX_PATH
  const int64_t C = s.in_c, O = s.out_c, taps = s.k_h * s.k_w;
  const bool binary = act_est != Estimator::kNone;
  const int64_t c_pad = RoundUp(C, 32), o_pad = RoundUp(O, 32);
  // x's phases side by side (c_pad rows each) on the grid of one phase;
  // tap t reads its phase's rows x_row[t] on at its shift (file comment).
  // At stride 1 there is one phase, the whole input: the grid is
  // InputGrid(s) and the offsets are TapOffsets', by construction.
  const Phases ph = PhasesOf(s);
  const Grid grid =
      PaddedGrid(s.batch, -ph.dmin_h, -ph.dmin_w, ph.a_h, ph.a_w, s.out_h,
                 s.out_w, ph.dmax_h - ph.dmin_h, ph.dmax_w - ph.dmin_w);
  Taps tp;
  std::vector<int64_t> x_row;
  for (int64_t t = 0; t < taps; ++t) {
    tp.off.push_back((ph.dh[t] - ph.dmin_h) * grid.wp + ph.dw[t] - ph.dmin_w);
    tp.max_off = std::max(tp.max_off, tp.off.back());
    x_row.push_back(ph.phase[t] * c_pad);
  }
  const int64_t n_phases = ph.count();
  const int64_t q_len = RoundUp(grid.q_end(), 32);
  const int64_t qa = RoundUp(q_len + tp.max_off, 32);
  const int x_n = binary ? 1 : 3;

  // x_hat transposed onto the grid: x_parts[i][phase * c_pad + c][q].
  std::vector<std::unique_ptr<Buffer>> xb;
  std::vector<const uint16_t*> x_parts;
  for (int i = 0; i < x_n; ++i) {
    xb.emplace_back(new Buffer(n_phases * c_pad * qa));
    x_parts.push_back(xb.back()->p);
  }
  // Blocks of 128 grid rows by 32 channels: split row-major into tmp (L1),
  // then write each channel's run of 128 values.
  constexpr int64_t kQBlock = 128;
  const int64_t q_blocks = (qa + kQBlock - 1) / kQBlock;
  const int64_t c_blocks = n_phases * c_pad / 32;
  parallel_for(
      q_blocks * c_blocks, kQBlock * 32 * 8, [&](int64_t v0, int64_t v1) {
        std::vector<uint16_t> tmp(kQBlock * 96);
        for (int64_t v = v0; v < v1; ++v) {
          const int64_t q0 = v / c_blocks * kQBlock;
          const int64_t row0 = v % c_blocks * 32;  // phase * c_pad + c0
          const int64_t f = row0 / c_pad, c0 = row0 % c_pad;
          const int64_t nq = std::min(kQBlock, qa - q0);
          const int64_t nc =
              std::max<int64_t>(0, std::min<int64_t>(32, C - c0));
          grid.WalkCoords(q0, nq, /*data=*/true,
                          [&](int64_t i, int64_t n, int64_t a, int64_t b) {
                            uint16_t* row = &tmp[i * 96];
                            const int64_t p = ph.Full(f, n, a, b);
                            if (p < 0 || nc == 0) {
                              std::fill(row, row + 96, uint16_t{0});
                            } else if (binary) {
                              if (packed != nullptr) {
                                SignRowFromBits(packed + p * PackedBytes(C), c0,
                                                nc, row);
                              } else {
                                SignRow(x + p * C + c0, nc, row);
                              }
                            } else {
                              SplitRow(x + p * C + c0, nullptr, nc, 32, row);
                            }
                          });
          for (int i = 0; i < x_n; ++i) {  // nq is a multiple of 32
            for (int64_t c8 = 0; c8 < 32; c8 += 8) {
              for (int64_t q8 = 0; q8 < nq; q8 += 8) {
                Transpose8x8(&tmp[q8 * 96 + i * 32 + c8], 96,
                             xb[i]->p + (row0 + c8) * qa + q0 + q8, qa);
              }
            }
          }
        }
      });

  static const int kBinX[] = {0, 0, 0}, kBinD[] = {0, 1, 2};
  // dy's parts: the binary-input dW's products x_hat * part are exact for
  // any split; a float x keeps the exact split (its six products).
  const int dy_parts = binary ? static_cast<int>(dy_split) : 3;
  static const int kFloatX[] = {0, 0, 0, 1, 1, 2},
                   kFloatD[] = {0, 1, 2, 0, 1, 0};
  const int64_t c_pairs = c_pad / 32, o_pairs = o_pad / 32;
  const int64_t units = taps * c_pairs * o_pairs;
  // An item's columns of x and dy fill about 1 MiB of L2 (more thrashes it).
  // All of K in one block lets each unit's sums go straight to dW, with no
  // partial sums through memory; it may take halving the channels per item,
  // repeatedly (each part then re-reads its slice of dy, which its thread
  // keeps split when the parts of one o pair run in a row): halving only
  // once left deep layers' dW in several k blocks whose partial sums went
  // through memory. Set by bench/backprops.py; docs/performance.md.
  constexpr int64_t kItemBytes = int64_t{1} << 20;
  auto bytes_per_q = [&](int64_t c_group) {  // an item reads every phase
    return (x_n * 32 * c_group * n_phases + 3 * 32) * 2;
  };
  int64_t c_group = c_pairs;
  int64_t smaller = c_pairs;
  while (q_len * bytes_per_q(c_group) > kItemBytes && smaller > 1) {
    smaller = (smaller + 1) / 2;
    if (q_len * bytes_per_q(smaller) <= kItemBytes) c_group = smaller;
  }
  const int64_t kblock = std::min(
      q_len,
      std::max<int64_t>(32, kItemBytes / bytes_per_q(c_group) / 32 * 32));
  const int64_t k_blocks = (q_len + kblock - 1) / kblock;
  const int64_t c_groups = (c_pairs + c_group - 1) / c_group;
  const std::vector<float> scale = PaddedScale(alpha, O);
  const float clip_f = static_cast<float>(clip);
  // dw of unit u from its summed tiles a (4 x [16][16], as FilterGemm).
  auto finish = [&](int64_t u, const float* a) {
    const int64_t t = u / (c_pairs * o_pairs), rem = u % (c_pairs * o_pairs);
    const int64_t c0 = rem / o_pairs * 32, o0 = rem % o_pairs * 32;
    for (int64_t r = 0; r < 32 && c0 + r < C; ++r) {
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t o = o0 + half * 16;
        const int64_t n = std::min<int64_t>(16, O - o);
        if (n <= 0) break;
        const float* src = a + ((r / 16) * 2 + half) * 256 + (r % 16) * 16;
        const int64_t i = (t * C + c0 + r) * O + o;
        if (w_est == Estimator::kNone || w_est == Estimator::kSteSign) {
          ScaleAndMask(src, scale.data() + o, w + i,
                       w_est == Estimator::kSteSign ? clip_f : -1.0f, n,
                       dw + i);
          continue;
        }
        for (int64_t k = 0; k < n; ++k) {
          dw[i + k] = src[k] * scale[o + k] * ActGrad(w_est, w[i + k], clip);
        }
      }
    }
  };
  std::unique_ptr<Buffer> partial_buf(
      k_blocks > 1 ? new Buffer(k_blocks * units * 1024 * 2) : nullptr);
  FilterGemm g;
  g.x_parts = x_parts.data();
  g.qa = qa;
  // Each item splits its own 32 channels of dy on its k block into its
  // thread's buffer, pair-interleaved: [part][q / 2][32][2], one contiguous
  // run per part that stays in L2 for every tap and c pair of the item.
  // (Splitting all of dy up front wrote and re-read more than its size
  // through memory; and rows of all o_pad channels put an item's slices
  // o_pad * 4 bytes apart, which for wide layers overfilled L2 sets.)
  g.fill_d = [&](int64_t q0, int64_t q1, int64_t op, uint16_t* const* out) {
    const int64_t o0 = op * 32, n = std::min<int64_t>(32, O - o0);
    for (int64_t pr = q0 / 2; pr < q1 / 2; ++pr) {
      const int64_t a = grid.OutPixel(2 * pr), b = grid.OutPixel(2 * pr + 1);
      InterleaveSplitPair(a < 0 ? nullptr : dy + a * O + o0,
                          b < 0 ? nullptr : dy + b * O + o0, n, 32,
                          (pr - q0 / 2) * 64, out, dy_parts);
    }
  };
  g.q_len = q_len;
  g.kblock = kblock;
  g.off = tp.off.data();
  g.x_row = x_row.data();
  g.taps = taps;
  g.c_pairs = c_pairs;
  g.o_pairs = o_pairs;
  g.c_group = c_group;
  g.x_of = binary ? kBinX : kFloatX;
  g.d_of = binary ? kBinD : kFloatD;
  g.n_pairs = binary ? dy_parts : 6;
  g.partial = partial_buf ? reinterpret_cast<float*>(partial_buf->p) : nullptr;
  if (k_blocks == 1) g.finish = finish;
  parallel_for(k_blocks * o_pairs * c_groups,
               kblock * 32 * 32 * c_group * taps * g.n_pairs / 8,
               [&](int64_t i0, int64_t i1) { FilterGemmItems(g, i0, i1); });

  if (k_blocks > 1) {  // sum the k blocks' partial sums, then finish
    parallel_for(units, 1024, [&](int64_t u0, int64_t u1) {
      alignas(64) float a[1024];
      for (int64_t u = u0; u < u1; ++u) {
        std::copy_n(g.partial + u * 1024, 1024, a);
        for (int64_t kb = 1; kb < k_blocks; ++kb) {
          const float* src = g.partial + (kb * units + u) * 1024;
          for (int i = 0; i < 1024; ++i) a[i] += src[i];
        }
        finish(u, a);
      }
    });
  }
  return true;
#else
  return false;
#endif
}

}  // namespace

bool BackpropInput(const ConvShape& s, const float* x, const float* w,
                   const float* dy, Estimator act_est, double clip,
                   const float* alpha, float* dx,
                   const ParallelFor& parallel_for, DySplit dy_split) {
  return BackpropInputImpl(s, x, nullptr, w, dy, act_est, clip, alpha, dx,
                           parallel_for, dy_split);
}

bool BackpropFilter(const ConvShape& s, const float* x, const float* w,
                    const float* dy, Estimator act_est, Estimator w_est,
                    double clip, const float* alpha, float* dw,
                    const ParallelFor& parallel_for, DySplit dy_split) {
  return BackpropFilterImpl(s, x, nullptr, w, dy, act_est, w_est, clip, alpha,
                            dw, parallel_for, dy_split);
}

bool BackpropInputPacked(const ConvShape& s, const uint8_t* packed,
                         const float* w, const float* dy, const float* alpha,
                         float* dx, const ParallelFor& parallel_for,
                         DySplit dy_split) {
  return BackpropInputImpl(s, nullptr, packed, w, dy, Estimator::kSteSign, 1.0,
                           alpha, dx, parallel_for, dy_split);
}

bool BackpropFilterPacked(const ConvShape& s, const uint8_t* packed,
                          const float* w, const float* dy, Estimator w_est,
                          double clip, const float* alpha, float* dw,
                          const ParallelFor& parallel_for, DySplit dy_split) {
  return BackpropFilterImpl(s, nullptr, packed, w, dy, Estimator::kSteSign,
                            w_est, clip, alpha, dw, parallel_for, dy_split);
}

}  // namespace amx
}  // namespace tapehook
