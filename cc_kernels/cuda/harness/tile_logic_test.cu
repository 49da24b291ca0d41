// Host test of conv_tiles.h (no GPU): each CUDA kernel's GEMM is replayed on
// the host through the same loader and epilogue functions the kernel calls,
// over the kernel's padded tile ranges, and compared with the CPU core.
//
//   nvcc -std=c++17 -Icc_kernels cc_kernels/cuda/harness/tile_logic_test.cu
//        cc_kernels/core/binary_conv.cc cc_kernels/core/amx_conv.cc -o /tmp/t
//        && /tmp/t
//
// The tensor-core path (tc_tiles.h) is replayed the same way: operands
// staged by its staging functions, each GEMM element read through its
// segment functions over the kernels' padded ranges, hi and lo planes
// multiplied as the kernels' products are.
//
// What this does not cover (needs a GPU, bench/cuda_harness.py): thread to
// tile mapping, shared memory, synchronization, launch configuration.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/binary_conv.h"
#include "cuda/conv_tiles.h"
#include "cuda/tc_tiles.h"

namespace {

using namespace tapehook;
using namespace tapehook::cuda;

int g_checks = 0, g_failures = 0;

void Check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

// The kernels' reduction steps and tile edge (binary_conv.cu).
constexpr int kTile = 64, kDepth = 16, kWordDepth = 8;
int RoundUp(int n, int m) { return (n + m - 1) / m * m; }

void InlineFor(int64_t total, int64_t,
               const std::function<void(int64_t, int64_t)>& fn) {
  if (total > 0) fn(0, total);
}

struct Case {
  int64_t batch, in_h, in_w, in_c, k_h, k_w, out_c, stride_h, stride_w, dil_h,
      dil_w;
  Padding padding;
  int64_t pt, pb, pl, pr;
};

struct Spec {
  bool binary;
  Estimator act, weight;
  Scale scale;
  float clip;
};

const Spec kSpecs[] = {
    {false, Estimator::kNone, Estimator::kSteSign, Scale::kNone, 1.0f},
    {true, Estimator::kSteSign, Estimator::kSteSign, Scale::kMeanAbs, 1.0f},
    {true, Estimator::kApproxSign, Estimator::kSwishSign, Scale::kNone, 0.5f},
    {false, Estimator::kNone, Estimator::kApproxSign, Scale::kMeanAbs, 1.0f},
    {true, Estimator::kSwishSign, Estimator::kSteSign, Scale::kMeanAbs, 0.5f},
};

// alpha as AlphaKernel computes it: kAlphaRows strided partial sums.
template <typename T>
std::vector<float> Alpha(const Geom& g, const T* w, Scale scale) {
  std::vector<float> alpha(g.out_c, 1.0f);
  if (scale != Scale::kMeanAbs) return alpha;
  constexpr int kAlphaRows = 32;
  for (int o = 0; o < g.out_c; ++o) {
    float sum = 0.0f;
    for (int r = 0; r < kAlphaRows; ++r) {
      sum += AbsColumnSum(g, w, o, r, kAlphaRows);
    }
    alpha[o] = sum / float(g.filter_k);
  }
  return alpha;
}

template <typename T>
std::vector<float> ForwardBinary(const Geom& g, const T* x, const T* w,
                                 Scale scale) {
  std::vector<uint32_t> xbits(size_t(g.in_pix) * g.words);
  for (int pix = 0; pix < g.in_pix; ++pix) {
    for (int j = 0; j < g.words; ++j) {
      xbits[pix * g.words + j] = PackSignWord(x + pix * g.in_c, 1, j, g.in_c);
    }
  }
  std::vector<uint32_t> wbits(size_t(g.taps) * g.words * g.out_c);
  std::vector<int> wpop(size_t(g.taps) * g.out_c);
  for (int tap = 0; tap < g.taps; ++tap) {
    for (int o = 0; o < g.out_c; ++o) {
      wpop[tap * g.out_c + o] = PackFilterTap(g, w, tap, o, wbits.data());
    }
  }
  const std::vector<float> alpha = Alpha(g, w, scale);
  std::vector<float> y(size_t(g.out_pix) * g.out_c);
  const int depth = RoundUp(g.taps * g.words, kWordDepth);
  for (int p = 0; p < RoundUp(g.out_pix, kTile); ++p) {
    const OutPixel px = OutPixelAt(g, p);
    for (int o = 0; o < RoundUp(g.out_c, kTile); ++o) {
      int mismatches = 0;
      for (int kw = 0; kw < depth; ++kw) {
        mismatches +=
            Popcount(PackedIm2ColWord(g, xbits.data(), px, PackedRowAt(g, kw)) ^
                     PackedWeightWord(g, wbits.data(), kw, o));
      }
      if (px.valid && o < g.out_c) {
        y[p * g.out_c + o] =
            alpha[o] * BinaryDotEpilogue(g, wpop.data(), px, o, mismatches);
      }
    }
  }
  return y;
}

template <typename T>
std::vector<float> ForwardFloat(const Geom& g, const T* x, const T* w,
                                Scale scale) {
  const std::vector<float> alpha = Alpha(g, w, scale);
  std::vector<float> y(size_t(g.out_pix) * g.out_c);
  for (int p = 0; p < RoundUp(g.out_pix, kTile); ++p) {
    const OutPixel px = OutPixelAt(g, p);
    for (int o = 0; o < RoundUp(g.out_c, kTile); ++o) {
      float acc = 0.0f;
      for (int k = 0; k < RoundUp(g.filter_k, kDepth); ++k) {
        acc += Im2ColValue(g, x, false, px, FilterRowAt(g, k)) *
               SignWeight(g, w, k, o);
      }
      if (px.valid && o < g.out_c) y[p * g.out_c + o] = acc * alpha[o];
    }
  }
  return y;
}

// dx of a BackpropInput kernel replayed over its padded tile ranges (rows
// of input pixels, columns of channels): sum(q, c) is the GEMM's sum for
// input pixel q and channel c, stored inside the tensor through the
// kernels' epilogue.
template <typename T, class Sum>
std::vector<float> DxOverTiles(const Geom& g, const T* x, const Spec& sp,
                               int rows, int cols, const Sum& sum) {
  std::vector<float> dx(size_t(g.in_pix) * g.in_c);
  for (int qi = 0; qi < RoundUp(g.in_pix, rows); ++qi) {
    const InPixel q = InPixelAt(g, qi);
    for (int c = 0; c < RoundUp(g.in_c, cols); ++c) {
      const float acc = sum(q, c);
      if (qi >= g.in_pix || c >= g.in_c) continue;
      const int idx = qi * g.in_c + c;
      dx[idx] = BackpropInputEpilogue(x, idx, sp.act, sp.clip, acc);
    }
  }
  return dx;
}

template <typename T>
std::vector<float> BackpropInputHost(const Geom& g, const T* x, const T* w,
                                     const T* dy, const Spec& sp) {
  const std::vector<float> alpha = Alpha(g, w, sp.scale);
  const int depth = RoundUp(g.taps * g.out_c, kDepth);
  return DxOverTiles(g, x, sp, kTile, kTile, [&](InPixel row, int c) {
    float acc = 0.0f;
    for (int k = 0; k < depth; ++k) {
      const DyColumn col = DyColumnAt(g, k);
      acc += DyGatherValue(g, dy, row, col) *
             ScaledSignWeightT(g, w, alpha.data(), col, c);
    }
    return acc;
  });
}

template <typename T>
std::vector<float> BackpropFilterHost(const Geom& g, const T* x, const T* w,
                                      const T* dy, const Spec& sp, int splits) {
  const int kn = g.filter_k * g.out_c;
  std::vector<float> partial(size_t(splits) * kn);
  for (int z = 0; z < splits; ++z) {
    int begin, end;
    SplitRange(g.out_pix, splits, kDepth, z, &begin, &end);
    for (int k = 0; k < RoundUp(g.filter_k, kTile); ++k) {
      const FilterRow f = FilterRowAt(g, k);
      for (int o = 0; o < RoundUp(g.out_c, kTile); ++o) {
        float acc = 0.0f;
        for (int p = begin; p < begin + RoundUp(end - begin, kDepth); ++p) {
          const OutPixel px =
              p < end ? OutPixelAt(g, p) : OutPixel{0, 0, 0, false};
          acc += Im2ColValue(g, x, sp.binary, px, f) *
                 (p < end ? DyValue(g, dy, p, o) : 0.0f);
        }
        if (k < g.filter_k && o < g.out_c) {
          partial[z * kn + k * g.out_c + o] = acc;
        }
      }
    }
  }
  const std::vector<float> alpha = Alpha(g, w, sp.scale);
  std::vector<float> dw(kn);
  for (int i = 0; i < kn; ++i) {
    float sum = 0.0f;
    for (int z = 0; z < splits; ++z) sum += partial[z * kn + i];
    dw[i] = sum * (alpha[i % g.out_c] *
                   EstimatorGradF(sp.weight, ToFloat(w[i]), sp.clip));
  }
  return dw;
}

// ---------------------------------------------------------------------------
// Tensor-core path (tc_conv.cu): its tile edge and reduction step.
constexpr int kTcRows = 128, kTcDepth = 32;

// A staged tensor's planes, bf16 values widened to float (lo empty: a sign).
struct Staged {
  std::vector<float> hi, lo;
  float Hi(int off, int e) const { return off < 0 ? 0.0f : hi[off + e]; }
  float Lo(int off, int e) const {
    return off < 0 || lo.empty() ? 0.0f : lo[off + e];
  }
};

template <typename T>
Staged StageFloatHost(const T* src, int rows, int cols, int pitch,
                      const float* scale) {
  Staged out{std::vector<float>(size_t(rows) * pitch),
             std::vector<float>(size_t(rows) * pitch)};
  for (int i = 0; i < rows * pitch; ++i) {
    __nv_bfloat16 hi, lo;
    SplitBf16(StagedValue(src, cols, scale, i / pitch, i % pitch), &hi, &lo);
    out.hi[i] = __bfloat162float(hi);
    out.lo[i] = __bfloat162float(lo);
  }
  return out;
}

template <typename T>
Staged StageSignHost(const T* src, int rows, int cols, int pitch) {
  Staged out{std::vector<float>(size_t(rows) * pitch), {}};
  for (int i = 0; i < rows * pitch; ++i) {
    out.hi[i] = StagedSign(src, cols, i / pitch, i % pitch);
  }
  return out;
}

template <typename T>
Staged StageFilterHost(const TcGeom& t, const T* w) {
  Staged out{std::vector<float>(size_t(t.g.taps) * t.cp * t.op), {}};
  for (size_t i = 0; i < out.hi.size(); ++i) {
    out.hi[i] = StagedFilterSign(t, w, int(i));
  }
  return out;
}

template <typename T>
std::vector<float> TcForwardHost(const Geom& g, const T* x, const T* w,
                                 const Spec& sp) {
  const TcGeom t = MakeTcGeom(g);
  const Staged xs = sp.binary ? StageSignHost(x, g.in_pix, g.in_c, t.cp)
                              : StageFloatHost(x, g.in_pix, g.in_c, t.cp,
                                               (const float*)nullptr);
  const Staged ws = StageFilterHost(t, w);
  const std::vector<float> alpha = Alpha(g, w, sp.scale);
  std::vector<float> y(size_t(g.out_pix) * g.out_c);
  for (int p = 0; p < RoundUp(g.out_pix, kTcRows); ++p) {
    const OutPixel px = OutPixelAt(g, p);
    for (int o = 0; o < RoundUp(g.out_c, 64); ++o) {
      float acc = 0.0f;
      TapWalk walk;  // the kernel's order of (tap, k0)
      for (int step = 0; step < g.taps * RoundUp(t.cp, kTcDepth) / kTcDepth;
           ++step, walk.Next(g, kTcDepth, t.cp)) {
        const int tap = walk.tap;
        if (p == 0 && o == 0) {
          Check(walk.dh == TapDh(g, tap) && walk.dw == TapDw(g, tap),
                "TapWalk offsets");
        }
        for (int c = walk.k0; c < walk.k0 + kTcDepth; ++c) {
          const int a = TcForwardA(t, px, walk.dh, walk.dw, c / 8 * 8);
          const float b = ws.Hi(TcFilter(t, tap, c, o / 8 * 8), o % 8);
          acc += xs.Hi(a, c % 8) * b + xs.Lo(a, c % 8) * b;
        }
      }
      if (px.valid && o < g.out_c) y[p * g.out_c + o] = acc * alpha[o];
    }
  }
  return y;
}

// The fully binary forward on int8 (TcForwardInt8Kernel): int sums.
template <typename T>
std::vector<float> TcForwardInt8Host(const Geom& g, const T* x, const T* w,
                                     const Spec& sp) {
  const TcGeom t = MakeTcGeom(g);
  std::vector<int> xs(size_t(g.in_pix) * t.cq);
  for (size_t i = 0; i < xs.size(); ++i) {
    xs[i] = int(StagedSign(x, g.in_c, int(i / t.cq), int(i % t.cq)));
  }
  std::vector<int> wt(size_t(g.taps) * g.out_c * t.cq);
  for (size_t i = 0; i < wt.size(); ++i) {
    wt[i] = int(StagedFilterSignT(t, w, int(i)));
  }
  auto at = [](const std::vector<int>& v, int off, int e) {
    return off < 0 ? 0 : v[off + e];
  };
  const std::vector<float> alpha = Alpha(g, w, sp.scale);
  std::vector<float> y(size_t(g.out_pix) * g.out_c);
  constexpr int kDepth8 = 2 * kTcDepth;
  for (int p = 0; p < RoundUp(g.out_pix, kTcRows); ++p) {
    const OutPixel px = OutPixelAt(g, p);
    for (int o = 0; o < RoundUp(g.out_c, 64); ++o) {
      int acc = 0;
      TapWalk walk;
      for (int step = 0; step < g.taps * RoundUp(t.cq, kDepth8) / kDepth8;
           ++step, walk.Next(g, kDepth8, t.cq)) {
        for (int c = walk.k0; c < walk.k0 + kDepth8; ++c) {
          acc += at(xs, TcForwardA8(t, px, walk.dh, walk.dw, c / 16 * 16),
                    c % 16) *
                 at(wt, TcFilterT8(t, walk.tap, o, c / 16 * 16), c % 16);
        }
      }
      if (px.valid && o < g.out_c) y[p * g.out_c + o] = float(acc) * alpha[o];
    }
  }
  return y;
}

template <typename T>
std::vector<float> TcBackpropInputHost(const Geom& g, const T* x, const T* w,
                                       const T* dy, const Spec& sp) {
  const TcGeom t = MakeTcGeom(g);
  const std::vector<float> alpha = Alpha(g, w, sp.scale);
  const Staged dys = StageFloatHost(dy, g.out_pix, g.out_c, t.op, alpha.data());
  const Staged ws = StageFilterHost(t, w);
  return DxOverTiles(g, x, sp, kTcRows, 64, [&](InPixel q, int c) {
    float acc = 0.0f;
    TapWalk walk;
    for (int step = 0; step < g.taps * RoundUp(t.op, kTcDepth) / kTcDepth;
         ++step, walk.Next(g, kTcDepth, t.op)) {
      for (int o = walk.k0; o < walk.k0 + kTcDepth; ++o) {
        const int a = TcBackpropInputA(t, q, walk.dh, walk.dw, o / 8 * 8);
        const float b = ws.Hi(TcFilter(t, walk.tap, c, o / 8 * 8), o % 8);
        acc += dys.Hi(a, o % 8) * b + dys.Lo(a, o % 8) * b;
      }
    }
    return acc;
  });
}

template <typename T>
std::vector<float> TcBackpropFilterHost(const Geom& g, const T* x, const T* w,
                                        const T* dy, const Spec& sp,
                                        int splits) {
  const TcGeom t = MakeTcGeom(g);
  const Staged xs = sp.binary ? StageSignHost(x, g.in_pix, g.in_c, t.cp)
                              : StageFloatHost(x, g.in_pix, g.in_c, t.cp,
                                               (const float*)nullptr);
  const Staged dys =
      StageFloatHost(dy, g.out_pix, g.out_c, t.op, (const float*)nullptr);
  const int kn = g.filter_k * g.out_c;
  std::vector<float> partial(size_t(splits) * kn, 0.0f);
  std::vector<int> written(kn, 0);
  for (int z = 0; z < splits; ++z) {
    int begin, end;
    SplitRange(g.out_pix, splits, kTcDepth, z, &begin, &end);
    for (int m = 0; m < RoundUp(g.taps * t.cp, kTcRows); ++m) {
      for (int o = 0; o < RoundUp(g.out_c, 64); ++o) {
        float acc = 0.0f;
        for (int p = begin; p < begin + RoundUp(end - begin, kTcDepth); ++p) {
          const OutPixel px =
              p < end ? OutPixelAt(g, p) : OutPixel{0, 0, 0, false};
          const int a = TcBackpropFilterA(t, px, m / 8 * 8);
          const int b = TcDy(t, p, p < end, o / 8 * 8);
          acc += xs.Hi(a, m % 8) * dys.Hi(b, o % 8) +
                 xs.Hi(a, m % 8) * dys.Lo(b, o % 8) +
                 xs.Lo(a, m % 8) * dys.Hi(b, o % 8);
        }
        const int row = TcFilterRow(t, m);
        if (row >= 0 && o < g.out_c) {
          partial[z * kn + row * g.out_c + o] = acc;
          written[row * g.out_c + o] += z == 0;
        }
      }
    }
  }
  bool each_once = true;
  for (int n : written) each_once &= n == 1;
  Check(each_once, "tc backprop_filter writes every dw element once");
  const std::vector<float> alpha = Alpha(g, w, sp.scale);
  std::vector<float> dw(kn);
  for (int i = 0; i < kn; ++i) {
    float sum = 0.0f;
    for (int z = 0; z < splits; ++z) sum += partial[z * kn + i];
    dw[i] = sum * (alpha[i % g.out_c] *
                   EstimatorGradF(sp.weight, ToFloat(w[i]), sp.clip));
  }
  return dw;
}

// |a - e| <= tol * (1 + max|e|), as tests/conftest.py.
void Compare(const std::vector<float>& got, const std::vector<float>& want,
             double tol, const std::string& what) {
  double scale = 1.0, err = 0.0;
  for (float v : want) scale = std::max(scale, 1.0 + std::fabs(v));
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::fabs(double(got[i]) - want[i]));
  }
  Check(got.size() == want.size() && err <= tol * scale,
        what + ": max error " + std::to_string(err));
}

// Rounds through T (identity for float, half for __half).
template <typename T>
std::vector<T> As(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FromFloat<T>(v[i]);
  return out;
}
template <typename T>
std::vector<float> Widen(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = ToFloat(v[i]);
  return out;
}

template <typename T>
void RunCase(const Case& c, const Spec& sp, const ConvShape& s,
             std::mt19937& rng, double tol, const std::string& name) {
  const Geom g = MakeGeom(s);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(s.batch * s.in_h * s.in_w * s.in_c);
  std::vector<float> w(s.k_h * s.k_w * s.in_c * s.out_c);
  std::vector<float> dy(s.batch * s.out_h * s.out_w * s.out_c);
  for (float& v : x) v = unit(rng) < 0.05f ? 0.0f : 1.2f * normal(rng);
  for (float& v : w) v = 0.8f * normal(rng);
  w[0] = 0.0f;  // sign(0) = +1
  for (float& v : dy) v = normal(rng);
  // The kernel sees T; the core sees the same values widened to float.
  const std::vector<T> xt = As<T>(x), wt = As<T>(w), dyt = As<T>(dy);
  const std::vector<float> xr = Widen(xt), wr = Widen(wt), dyr = Widen(dyt);
  auto rounded = [](std::vector<float> v) { return Widen(As<T>(v)); };

  std::vector<float> want(dy.size());
  BinaryConv2DForward<float>(s, xr.data(), wr.data(), sp.binary, sp.scale,
                             want.data(), InlineFor);
  const std::vector<float> y =
      sp.binary ? ForwardBinary(g, xt.data(), wt.data(), sp.scale)
                : ForwardFloat(g, xt.data(), wt.data(), sp.scale);
  Compare(rounded(y), want, tol, name + " forward");
  Compare(rounded(TcForwardHost(g, xt.data(), wt.data(), sp)), want, tol,
          name + " tc forward");
  if (sp.binary) {
    Compare(rounded(TcForwardInt8Host(g, xt.data(), wt.data(), sp)), want, tol,
            name + " tc int8 forward");
  }

  want.assign(x.size(), 0.0f);
  BinaryConv2DBackpropInput<float>(s, xr.data(), wr.data(), dyr.data(), sp.act,
                                   sp.clip, sp.scale, want.data(), InlineFor);
  Compare(rounded(BackpropInputHost(g, xt.data(), wt.data(), dyt.data(), sp)),
          want, tol, name + " backprop_input");
  Compare(rounded(TcBackpropInputHost(g, xt.data(), wt.data(), dyt.data(), sp)),
          want, tol, name + " tc backprop_input");

  want.assign(w.size(), 0.0f);
  BinaryConv2DBackpropFilter<float>(s, xr.data(), wr.data(), dyr.data(), sp.act,
                                    sp.weight, sp.clip, sp.scale, want.data(),
                                    InlineFor);
  for (int splits : {1, 3, 7}) {
    Compare(rounded(BackpropFilterHost(g, xt.data(), wt.data(), dyt.data(), sp,
                                       splits)),
            want, tol,
            name + " backprop_filter splits=" + std::to_string(splits));
    Compare(rounded(TcBackpropFilterHost(g, xt.data(), wt.data(), dyt.data(),
                                         sp, splits)),
            want, tol,
            name + " tc backprop_filter splits=" + std::to_string(splits));
  }
}

// Index helpers against their definitions, independently of any kernel.
void CheckIndexHelpers(const Geom& g, const std::string& name) {
  for (int p = 0; p < g.out_pix; ++p) {
    const OutPixel px = OutPixelAt(g, p);
    int valid = 0;
    for (int tap = 0; tap < g.taps; ++tap) {
      const int dh = tap / g.k_w * g.dil_h, dw = tap % g.k_w * g.dil_w;
      const int pix = InputPixelIndex(g, px, dh, dw);
      if (pix < 0) continue;
      ++valid;
      // The backprop-input gather maps this input pixel back to p.
      const InPixel q = InPixelAt(g, pix);
      int oh, ow;
      const bool found = OutputCoord(q.ih, dh, g.stride_h, g.out_h, &oh) &&
                         OutputCoord(q.iw, dw, g.stride_w, g.out_w, &ow);
      Check(found && (q.n * g.out_h + oh) * g.out_w + ow == p,
            name + " gather inverts im2col at p=" + std::to_string(p));
    }
    Check(ValidTaps(g, px) == valid, name + " ValidTaps");
  }
  for (int total : {0, 1, 15, 16, 17, 100, 1000}) {
    for (int splits : {1, 2, 5, 64}) {
      int covered = 0, last_end = 0;
      bool aligned = true;
      for (int z = 0; z < splits; ++z) {
        int b, e;
        SplitRange(total, splits, kDepth, z, &b, &e);
        aligned &= b == last_end && (b % kDepth == 0 || b == total) && e >= b;
        covered += e - b;
        last_end = e;
      }
      Check(aligned && covered == total, name + " SplitRange");
    }
  }
}

}  // namespace

int main() {
  const Case cases[] = {
      // batch, in_h, in_w, in_c, k_h, k_w, out_c, strides, dilations, padding
      {1, 7, 6, 3, 3, 3, 5, 1, 1, 1, 1, Padding::kSame, 0, 0, 0, 0},
      {2, 9, 8, 33, 3, 3, 7, 2, 2, 1, 1, Padding::kSame, 0, 0, 0, 0},
      {1, 10, 9, 5, 3, 2, 4, 1, 2, 2, 1, Padding::kValid, 0, 0, 0, 0},
      {2, 8, 8, 65, 3, 3, 3, 2, 1, 1, 2, Padding::kExplicit, 2, 0, 1, 3},
      {1, 6, 7, 17, 5, 5, 70, 1, 1, 2, 2, Padding::kSame, 0, 0, 0, 0},
      {3, 5, 5, 32, 1, 1, 9, 2, 2, 1, 1, Padding::kValid, 0, 0, 0, 0},
      {2, 4, 6, 31, 2, 3, 6, 3, 1, 1, 3, Padding::kExplicit, 0, 1, 4, 0},
      {16, 4, 3, 3, 3, 3, 2, 1, 1, 1, 1, Padding::kSame, 0, 0, 0, 0},
  };
  std::mt19937 rng(7);
  int index = 0;
  for (const Case& c : cases) {
    ConvShape s;
    s.batch = c.batch, s.in_h = c.in_h, s.in_w = c.in_w, s.in_c = c.in_c;
    s.k_h = c.k_h, s.k_w = c.k_w, s.out_c = c.out_c;
    s.stride_h = c.stride_h, s.stride_w = c.stride_w;
    s.dil_h = c.dil_h, s.dil_w = c.dil_w;
    const std::string err =
        ComputeConvGeometry(c.padding, c.pt, c.pb, c.pl, c.pr, &s);
    const std::string name = "case" + std::to_string(index);
    Check(err.empty(), name + " geometry: " + err);
    if (!err.empty()) continue;
    CheckIndexHelpers(MakeGeom(s), name);
    const Spec& sp = kSpecs[index % (sizeof(kSpecs) / sizeof(kSpecs[0]))];
    const Spec& sp2 =
        kSpecs[(index + 2) % (sizeof(kSpecs) / sizeof(kSpecs[0]))];
    RunCase<float>(c, sp, s, rng, 1e-4, name + " float32");
    RunCase<__half>(c, sp2, s, rng, 2e-2, name + " float16");
    ++index;
  }
  std::printf("%d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
