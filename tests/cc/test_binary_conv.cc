// Standalone test of cc_kernels/core/binary_conv.cc (no TensorFlow).
//
//   g++ -std=c++17 -O2 -I. tests/cc/test_binary_conv.cc
//       cc_kernels/core/*.cc -lpthread -o /tmp/t && /tmp/t
//
// Every kernel is checked against naive double-precision loops written here
// from the definitions, over a seeded random sweep, and under three
// ParallelFor flavours (inline, 3 threads, one unit at a time in reverse).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc_kernels/core/amx_conv.h"
#include "cc_kernels/core/binary_conv.h"
#include "cc_kernels/core/cpu.h"
#include "cc_kernels/core/lut_backprop.h"
#include "cc_kernels/core/lut_backprop_avx2.h"
#include "cc_kernels/core/max_pool.h"
#include "cc_kernels/core/pack_input.h"
#include "cc_kernels/core/packed_backprop.h"
#include "cc_kernels/core/plan.h"

namespace {

using tapehook::ConvShape;
using tapehook::Estimator;
using tapehook::Padding;
using tapehook::ParallelFor;
using tapehook::Scale;

int g_failures = 0;

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (!(cond)) {                                                \
      ++g_failures;                                               \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
    }                                                             \
  } while (0)

// ---------------------------------------------------------------------------
// ParallelFor flavours.

void InlineFor(int64_t total, int64_t,
               const std::function<void(int64_t, int64_t)>& fn) {
  if (total > 0) fn(0, total);
}

// Three contiguous shards, each on its own thread.
void ThreadedFor(int64_t total, int64_t,
                 const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kThreads = 3;
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < kThreads; ++t) {
    const int64_t b = total * t / kThreads, e = total * (t + 1) / kThreads;
    if (b < e) threads.emplace_back([&fn, b, e] { fn(b, e); });
  }
  for (auto& th : threads) th.join();
}

// Single units, last first: catches code that assumes one shard or an order.
void ReverseUnitsFor(int64_t total, int64_t,
                     const std::function<void(int64_t, int64_t)>& fn) {
  for (int64_t i = total - 1; i >= 0; --i) fn(i, i + 1);
}

struct NamedFor {
  const char* name;
  ParallelFor pf;
};
const std::vector<NamedFor>& AllFors() {
  static const std::vector<NamedFor> fors = {{"inline", InlineFor},
                                             {"threads3", ThreadedFor},
                                             {"reverse", ReverseUnitsFor}};
  return fors;
}

// ---------------------------------------------------------------------------
// Reference math, from the definitions.

double RefSign(double t) { return t >= 0 ? 1.0 : -1.0; }

double RefEst(Estimator e, double t, double clip) {
  const double a = std::fabs(t);
  switch (e) {
    case Estimator::kNone:
      return 1.0;
    case Estimator::kSteSign:
      return a <= clip ? 1.0 : 0.0;
    case Estimator::kApproxSign:
      return a <= 1.0 ? 2.0 - 2.0 * a : 0.0;
    case Estimator::kSwishSign: {
      // 1 + cosh(u) == 2 cosh(u/2)^2; overflows to inf (result 0), not NaN.
      const double b = 5.0, u = b * t, ch = std::cosh(u / 2);
      return b * (2.0 - u * std::tanh(u / 2)) / (2.0 * ch * ch);
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

// TF's output size and leading pad for one axis; false if invalid.
bool RefAxis(Padding p, int64_t in, int64_t k, int64_t st, int64_t dil,
             int64_t pb, int64_t pa, int64_t* out, int64_t* pad) {
  const int64_t ek = (k - 1) * dil + 1;
  if (p == Padding::kSame) {
    *out = static_cast<int64_t>(std::ceil(double(in) / st));
    *pad = std::max<int64_t>(0, (*out - 1) * st + ek - in) / 2;
    return true;
  }
  if (p == Padding::kValid) {
    if (in < ek) return false;
    *out = static_cast<int64_t>(std::ceil(double(in - ek + 1) / st));
    *pad = 0;
    return true;
  }
  if (pb < 0 || pa < 0 || in + pb + pa < ek) return false;
  *out = static_cast<int64_t>(std::floor(double(in + pb + pa - ek) / st)) + 1;
  *pad = pb;
  return true;
}

// A reference result: the value and the sum of |terms| that produced it,
// which bounds the rounding error of any summation order.
struct Ref {
  std::vector<double> val, mag;
  explicit Ref(size_t n) : val(n, 0.0), mag(n, 0.0) {}
};

struct Problem {
  ConvShape s;
  std::vector<double> x, w, dy;  // exactly representable in float
  Estimator act_est, w_est;
  Scale scale;
  double clip;
};

std::vector<double> RefAlpha(const Problem& pr) {
  const ConvShape& s = pr.s;
  std::vector<double> alpha(s.out_c, 1.0);
  if (pr.scale == Scale::kMeanAbs) {
    // HWIO: output channel o is every out_c-th element, starting at o.
    std::vector<double> sum(s.out_c, 0.0);
    for (size_t i = 0; i < pr.w.size(); ++i) {
      sum[i % s.out_c] += std::fabs(pr.w[i]);
    }
    for (int64_t o = 0; o < s.out_c; ++o) {
      alpha[o] = sum[o] / double(s.k_h * s.k_w * s.in_c);
    }
  }
  return alpha;
}

int64_t XIdx(const ConvShape& s, int64_t n, int64_t h, int64_t w, int64_t c) {
  return ((n * s.in_h + h) * s.in_w + w) * s.in_c + c;
}
int64_t WIdx(const ConvShape& s, int64_t kh, int64_t kw, int64_t c, int64_t o) {
  return ((kh * s.k_w + kw) * s.in_c + c) * s.out_c + o;
}
int64_t YIdx(const ConvShape& s, int64_t n, int64_t h, int64_t w, int64_t o) {
  return ((n * s.out_h + h) * s.out_w + w) * s.out_c + o;
}

// Calls f(n, oh, ow, kh, kw, c, o, ih, iw) for every tap inside the input.
template <typename F>
void ForEachTap(const ConvShape& s, F f) {
  for (int64_t n = 0; n < s.batch; ++n)
    for (int64_t oh = 0; oh < s.out_h; ++oh)
      for (int64_t ow = 0; ow < s.out_w; ++ow)
        for (int64_t kh = 0; kh < s.k_h; ++kh)
          for (int64_t kw = 0; kw < s.k_w; ++kw) {
            const int64_t ih = oh * s.stride_h - s.pad_top + kh * s.dil_h;
            const int64_t iw = ow * s.stride_w - s.pad_left + kw * s.dil_w;
            if (ih < 0 || ih >= s.in_h || iw < 0 || iw >= s.in_w) continue;
            for (int64_t c = 0; c < s.in_c; ++c)
              for (int64_t o = 0; o < s.out_c; ++o)
                f(n, oh, ow, kh, kw, c, o, ih, iw);
          }
}

Ref RefForward(const Problem& pr) {
  const ConvShape& s = pr.s;
  const bool binary = pr.act_est != Estimator::kNone;
  const std::vector<double> alpha = RefAlpha(pr);
  Ref y(s.batch * s.out_h * s.out_w * s.out_c);
  ForEachTap(s, [&](int64_t n, int64_t oh, int64_t ow, int64_t kh, int64_t kw,
                    int64_t c, int64_t o, int64_t ih, int64_t iw) {
    const double xv = pr.x[XIdx(s, n, ih, iw, c)];
    const double t = (binary ? RefSign(xv) : xv) * alpha[o] *
                     RefSign(pr.w[WIdx(s, kh, kw, c, o)]);
    y.val[YIdx(s, n, oh, ow, o)] += t;
    y.mag[YIdx(s, n, oh, ow, o)] += std::fabs(t);
  });
  return y;
}

Ref RefBackpropInput(const Problem& pr) {
  const ConvShape& s = pr.s;
  const std::vector<double> alpha = RefAlpha(pr);
  Ref dx(pr.x.size());
  ForEachTap(s, [&](int64_t n, int64_t oh, int64_t ow, int64_t kh, int64_t kw,
                    int64_t c, int64_t o, int64_t ih, int64_t iw) {
    const double t = pr.dy[YIdx(s, n, oh, ow, o)] * alpha[o] *
                     RefSign(pr.w[WIdx(s, kh, kw, c, o)]);
    dx.val[XIdx(s, n, ih, iw, c)] += t;
    dx.mag[XIdx(s, n, ih, iw, c)] += std::fabs(t);
  });
  for (size_t i = 0; i < dx.val.size(); ++i) {
    const double g = RefEst(pr.act_est, pr.x[i], pr.clip);
    dx.val[i] *= g;
    dx.mag[i] *= std::fabs(g);
  }
  return dx;
}

Ref RefBackpropFilter(const Problem& pr) {
  const ConvShape& s = pr.s;
  const bool binary = pr.act_est != Estimator::kNone;
  const std::vector<double> alpha = RefAlpha(pr);
  Ref dw(pr.w.size());
  ForEachTap(s, [&](int64_t n, int64_t oh, int64_t ow, int64_t kh, int64_t kw,
                    int64_t c, int64_t o, int64_t ih, int64_t iw) {
    const double xv = pr.x[XIdx(s, n, ih, iw, c)];
    const double t = (binary ? RefSign(xv) : xv) * pr.dy[YIdx(s, n, oh, ow, o)];
    dw.val[WIdx(s, kh, kw, c, o)] += t;
    dw.mag[WIdx(s, kh, kw, c, o)] += std::fabs(t);
  });
  for (int64_t i = 0; i < static_cast<int64_t>(dw.val.size()); ++i) {
    const double g = alpha[i % s.out_c] * RefEst(pr.w_est, pr.w[i], pr.clip);
    dw.val[i] *= g;
    dw.mag[i] *= std::fabs(g);
  }
  return dw;
}

// ---------------------------------------------------------------------------
// Comparison.

struct Stats {
  int passed = 0, failed = 0;
  double max_err[2] = {0, 0};  // |got - ref| / sum|terms|, float / double
};
Stats g_stats;

template <typename T>
constexpr double Tol() {
  return sizeof(T) == 4 ? 1e-4 : 1e-10;
}

// True if got matches ref within tolerance; prints the first mismatch.
template <typename T>
bool Matches(const std::string& what, const std::vector<T>& got,
             const Ref& ref) {
  if (got.size() != ref.val.size()) {
    std::printf("  %s: size %zu vs %zu\n", what.c_str(), got.size(),
                ref.val.size());
    return false;
  }
  double& max_err = g_stats.max_err[sizeof(T) == 4 ? 0 : 1];
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - ref.val[i]);
    const double bound = Tol<T>() * ref.mag[i];
    if (!(err <= bound)) {  // also catches NaN (unwritten outputs)
      std::printf("  %s: index %zu got %.10g want %.10g (|terms| %.4g)\n",
                  what.c_str(), i, double(got[i]), ref.val[i], ref.mag[i]);
      return false;
    }
    if (ref.mag[i] > 0) max_err = std::max(max_err, err / ref.mag[i]);
  }
  return true;
}

// Outputs start as NaN so that unwritten elements fail the comparison.
template <typename T>
std::vector<T> NaNs(size_t n) {
  return std::vector<T>(n, std::numeric_limits<T>::quiet_NaN());
}

bool BitwiseEqual(const void* a, const void* b, size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}

template <typename T>
std::vector<T> Cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

std::string Describe(const Problem& pr, bool is_float) {
  const ConvShape& s = pr.s;
  char buf[400];
  std::snprintf(buf, sizeof(buf),
                "%s b=%lld in=%lldx%lldx%lld k=%lldx%lld out_c=%lld "
                "stride=%lld,%lld dil=%lld,%lld pad=%lld,%lld out=%lldx%lld "
                "act=%d w=%d scale=%d clip=%g",
                is_float ? "float" : "double", (long long)s.batch,
                (long long)s.in_h, (long long)s.in_w, (long long)s.in_c,
                (long long)s.k_h, (long long)s.k_w, (long long)s.out_c,
                (long long)s.stride_h, (long long)s.stride_w,
                (long long)s.dil_h, (long long)s.dil_w, (long long)s.pad_top,
                (long long)s.pad_left, (long long)s.out_h, (long long)s.out_w,
                int(pr.act_est), int(pr.w_est), int(pr.scale), pr.clip);
  return buf;
}

// Runs the three kernels under every ParallelFor; checks each result against
// the reference and that all ParallelFors give bitwise-identical results.
template <typename T>
bool RunCase(const Problem& pr) {
  const ConvShape& s = pr.s;
  const std::vector<T> x = Cast<T>(pr.x), w = Cast<T>(pr.w),
                       dy = Cast<T>(pr.dy);
  const bool binary = pr.act_est != Estimator::kNone;
  const Ref y_ref = RefForward(pr), dx_ref = RefBackpropInput(pr),
            dw_ref = RefBackpropFilter(pr);
  bool ok = true;
  std::vector<T> y0, dx0, dw0;
  for (const NamedFor& f : AllFors()) {
    const std::string tag = std::string(" [") + f.name + "]";
    std::vector<T> y = NaNs<T>(y_ref.val.size());
    tapehook::BinaryConv2DForward<T>(s, x.data(), w.data(), binary, pr.scale,
                                     y.data(), f.pf);
    std::vector<T> dx = NaNs<T>(x.size());
    tapehook::BinaryConv2DBackpropInput<T>(s, x.data(), w.data(), dy.data(),
                                           pr.act_est, pr.clip, pr.scale,
                                           dx.data(), f.pf);
    std::vector<T> dw = NaNs<T>(w.size());
    tapehook::BinaryConv2DBackpropFilter<T>(s, x.data(), w.data(), dy.data(),
                                            pr.act_est, pr.w_est, pr.clip,
                                            pr.scale, dw.data(), f.pf);
    ok &= Matches("forward" + tag, y, y_ref);
    ok &= Matches("backprop_input" + tag, dx, dx_ref);
    ok &= Matches("backprop_filter" + tag, dw, dw_ref);
    if (y0.empty() && dx0.empty() && dw0.empty()) {
      y0 = y, dx0 = dx, dw0 = dw;
    } else if (!BitwiseEqual(y.data(), y0.data(), y.size() * sizeof(T)) ||
               !BitwiseEqual(dx.data(), dx0.data(), dx.size() * sizeof(T)) ||
               !BitwiseEqual(dw.data(), dw0.data(), dw.size() * sizeof(T))) {
      std::printf("  results%s differ bitwise from [inline]\n", tag.c_str());
      ok = false;
    }
  }
  return ok;
}

// ---------------------------------------------------------------------------
// Random problems.

// Mostly uniform values, with exact zeros (sign(0) = +1), values exactly on
// the estimator edges, and a few huge ones (swish_sign's cosh overflow).
double Value(std::mt19937_64& rng, double clip) {
  std::uniform_real_distribution<double> u(0, 1);
  const double r = u(rng);
  if (r < 0.12) return 0.0;
  if (r < 0.20) {
    const double edges[] = {clip, -clip, 1.0, -1.0, 0.5, -0.5};
    return edges[std::uniform_int_distribution<int>(0, 5)(rng)];
  }
  if (r < 0.22) return u(rng) < 0.5 ? 200.0 : -200.0;
  // Rounded to float so both precisions see the same numbers.
  return static_cast<float>(3.0 * u(rng) - 1.5);
}

template <typename V>
V Pick(std::mt19937_64& rng, std::initializer_list<V> xs) {
  const int i = std::uniform_int_distribution<int>(0, int(xs.size()) - 1)(rng);
  return xs.begin()[i];
}

// Case i enumerates estimators, scale, clip and precision; the shape is
// random. Every 7th case has more channels (full GEMM tiles, depth
// blocking); every 13th has many pixels (many filter-gradient chunks, tap
// groups, several bit-im2col blocks); every 5th has channel counts around
// the 64-bit packing width and the popcount / GEMM tile widths (1, 3, 63,
// 64, 65, 130 in; 1, 15, 16, 17, 33 out). 5, 7 and 13 are coprime to the
// enumeration, so these meet every mix.
Problem RandomProblem(std::mt19937_64& rng, int i, bool* is_float) {
  Problem pr;
  pr.act_est = static_cast<Estimator>(i % 4);
  pr.w_est = static_cast<Estimator>(i / 4 % 4);
  pr.scale = static_cast<Scale>(i / 16 % 2);
  pr.clip = i / 32 % 2 ? 0.5 : 1.0;
  *is_float = i / 64 % 2 == 0;
  const bool large = i % 7 == 3;
  const bool wide = i % 13 == 6;
  const bool packing = i % 5 == 2;
  ConvShape& s = pr.s;
  while (true) {
    s = ConvShape();
    s.batch = Pick<int64_t>(rng, {1, 3});
    if (packing) {
      s.in_c = Pick<int64_t>(rng, {1, 3, 63, 64, 65, 130});
      s.out_c = Pick<int64_t>(rng, {1, 15, 16, 17, 33});
    } else if (large) {
      s.in_c = Pick<int64_t>(rng, {7, 17, 37});
      s.out_c = Pick<int64_t>(rng, {8, 19, 33});
    } else {
      s.in_c = Pick<int64_t>(rng, {1, 3, 5, 7});
      s.out_c = Pick<int64_t>(rng, {1, 3, 5, 7});
    }
    const int kernel = Pick<int>(rng, {0, 1, 2, 3});  // 1x1, 3x3, 2x3, 3x2
    s.k_h = kernel == 0 ? 1 : kernel == 2 ? 2 : 3;
    s.k_w = kernel == 0 ? 1 : kernel == 3 ? 2 : 3;
    s.stride_h = Pick<int64_t>(rng, {1, 2});
    s.stride_w = Pick<int64_t>(rng, {1, 2});
    s.dil_h = Pick<int64_t>(rng, {1, 2});
    s.dil_w = Pick<int64_t>(rng, {1, 2});
    std::uniform_int_distribution<int64_t> size(wide ? 24 : 1,
                                                wide    ? (packing ? 30 : 60)
                                                : large ? 14
                                                        : 9);
    s.in_h = size(rng);
    s.in_w = size(rng);
    const Padding padding = Pick<Padding>(
        rng, {Padding::kSame, Padding::kValid, Padding::kExplicit});
    std::uniform_int_distribution<int64_t> pad(0, 3);
    const int64_t pt = pad(rng), pb = pad(rng), pl = pad(rng), pr_ = pad(rng);
    int64_t oh, ph, ow, pw;
    const bool valid_h =
        RefAxis(padding, s.in_h, s.k_h, s.stride_h, s.dil_h, pt, pb, &oh, &ph);
    const bool valid_w =
        RefAxis(padding, s.in_w, s.k_w, s.stride_w, s.dil_w, pl, pr_, &ow, &pw);
    const std::string err =
        tapehook::ComputeConvGeometry(padding, pt, pb, pl, pr_, &s);
    CHECK(err.empty() == (valid_h && valid_w), "geometry validity: '%s'",
          err.c_str());
    if (!err.empty()) continue;  // too small for the filter; draw again
    CHECK(s.out_h == oh && s.out_w == ow && s.pad_top == ph && s.pad_left == pw,
          "geometry %lld %lld %lld %lld vs ref %lld %lld %lld %lld",
          (long long)s.out_h, (long long)s.out_w, (long long)s.pad_top,
          (long long)s.pad_left, (long long)oh, (long long)ow, (long long)ph,
          (long long)pw);
    break;
  }
  pr.x.resize(s.batch * s.in_h * s.in_w * s.in_c);
  pr.w.resize(s.k_h * s.k_w * s.in_c * s.out_c);
  pr.dy.resize(s.batch * s.out_h * s.out_w * s.out_c);
  for (double& v : pr.x) v = Value(rng, pr.clip);
  for (double& v : pr.w) v = Value(rng, pr.clip);
  std::uniform_real_distribution<double> u(-1, 1);
  for (double& v : pr.dy) v = static_cast<float>(u(rng));
  return pr;
}

// ---------------------------------------------------------------------------
// Fixed checks.

void TestGeometry() {
  struct Case {
    Padding p;
    int64_t in, k, stride, dil, pb, pa;
    bool ok;
    int64_t out, pad;
  };
  const Case cases[] = {
      {Padding::kSame, 7, 3, 2, 1, 0, 0, true, 4, 1},
      {Padding::kSame, 8, 3, 2, 1, 0, 0, true, 4, 0},
      {Padding::kSame, 5, 3, 1, 2, 0, 0, true, 5, 2},  // ek 5, pad total 4
      {Padding::kSame, 4, 4, 1, 1, 0, 0, true, 4, 1},  // pad total 3
      {Padding::kSame, 1, 1, 3, 1, 0, 0, true, 1, 0},
      {Padding::kSame, 2, 5, 1, 1, 0, 0, true, 2, 2},  // filter > input is ok
      {Padding::kValid, 7, 3, 2, 1, 0, 0, true, 3, 0},
      {Padding::kValid, 8, 3, 2, 1, 0, 0, true, 3, 0},
      {Padding::kValid, 7, 3, 1, 2, 0, 0, true, 3, 0},
      {Padding::kValid, 3, 3, 1, 1, 0, 0, true, 1, 0},
      {Padding::kValid, 2, 3, 1, 1, 0, 0, false, 0, 0},
      {Padding::kValid, 4, 3, 1, 2, 0, 0, false, 0, 0},  // ek 5
      {Padding::kExplicit, 7, 3, 2, 1, 2, 1, true, 4, 2},
      {Padding::kExplicit, 2, 3, 1, 1, 0, 1, true, 1, 0},
      {Padding::kExplicit, 5, 1, 1, 1, 0, 3, true, 8, 0},
      {Padding::kExplicit, 1, 3, 1, 1, 0, 1, false, 0, 0},
      {Padding::kExplicit, 7, 3, 1, 1, -1, 1, false, 0, 0},
      {Padding::kSame, 7, 3, 0, 1, 0, 0, false, 0, 0},  // stride 0
      {Padding::kSame, 7, 3, 1, 0, 0, 0, false, 0, 0},  // dilation 0
  };
  for (const Case& c : cases) {
    // Height gets the case; width a fixed valid axis, then the other way.
    for (int axis = 0; axis < 2; ++axis) {
      ConvShape s;
      s.batch = 2, s.in_c = 3, s.out_c = 4;
      int64_t* in[2] = {&s.in_h, &s.in_w};
      int64_t* k[2] = {&s.k_h, &s.k_w};
      int64_t* st[2] = {&s.stride_h, &s.stride_w};
      int64_t* dil[2] = {&s.dil_h, &s.dil_w};
      *in[axis] = c.in, *k[axis] = c.k, *st[axis] = c.stride,
      *dil[axis] = c.dil;
      *in[1 - axis] = 9, *k[1 - axis] = 1, *st[1 - axis] = 1,
              *dil[1 - axis] = 1;
      int64_t pads[4] = {0, 0, 0, 0};
      pads[2 * axis] = c.pb, pads[2 * axis + 1] = c.pa;
      const std::string err = tapehook::ComputeConvGeometry(
          c.p, pads[0], pads[1], pads[2], pads[3], &s);
      CHECK(err.empty() == c.ok, "padding %d in %lld k %lld axis %d: '%s'",
            int(c.p), (long long)c.in, (long long)c.k, axis, err.c_str());
      if (!c.ok || !err.empty()) continue;
      const int64_t out = axis == 0 ? s.out_h : s.out_w;
      const int64_t pad = axis == 0 ? s.pad_top : s.pad_left;
      const int64_t other_out = axis == 0 ? s.out_w : s.out_h;
      CHECK(out == c.out && pad == c.pad && other_out == 9,
            "padding %d in %lld k %lld s %lld: out %lld pad %lld, want "
            "%lld %lld",
            int(c.p), (long long)c.in, (long long)c.k, (long long)c.stride,
            (long long)out, (long long)pad, (long long)c.out, (long long)c.pad);
    }
  }
  ConvShape s;
  s.batch = 1, s.in_h = s.in_w = 4, s.in_c = 0, s.k_h = s.k_w = 1, s.out_c = 2;
  CHECK(!tapehook::ComputeConvGeometry(Padding::kSame, 0, 0, 0, 0, &s).empty(),
        "in_c 0 must be rejected");
}

void TestParsingAndEstimators() {
  Estimator e = Estimator::kNone;
  CHECK(tapehook::ParseEstimator("ste_sign", &e) && e == Estimator::kSteSign,
        "ste_sign");
  CHECK(tapehook::ParseEstimator("approx_sign", &e) &&
            e == Estimator::kApproxSign,
        "approx_sign");
  CHECK(
      tapehook::ParseEstimator("swish_sign", &e) && e == Estimator::kSwishSign,
      "swish_sign");
  CHECK(tapehook::ParseEstimator("none", &e) && e == Estimator::kNone, "none");
  CHECK(!tapehook::ParseEstimator("sign", &e), "unknown estimator accepted");
  Scale sc = Scale::kNone;
  CHECK(tapehook::ParseScale("mean_abs", &sc) && sc == Scale::kMeanAbs,
        "mean_abs");
  CHECK(tapehook::ParseScale("none", &sc) && sc == Scale::kNone, "none");
  CHECK(!tapehook::ParseScale("max_abs", &sc), "unknown scale accepted");

  using tapehook::EstimatorGrad;
  CHECK(EstimatorGrad(Estimator::kNone, 7.0, 1.0) == 1.0, "none");
  CHECK(EstimatorGrad(Estimator::kSteSign, 0.5, 0.5) == 1.0, "ste at clip");
  CHECK(EstimatorGrad(Estimator::kSteSign, -0.51, 0.5) == 0.0, "ste outside");
  CHECK(EstimatorGrad(Estimator::kApproxSign, -0.25, 0.5) == 1.5, "approx");
  CHECK(EstimatorGrad(Estimator::kApproxSign, 1.5, 2.0) == 0.0, "approx out");
  CHECK(std::fabs(EstimatorGrad(Estimator::kSwishSign, 0.0, 1.0) - 5.0) < 1e-15,
        "swish(0) = beta");
  // Where beta * t itself overflows the formula is inf / inf; the limit is 0.
  const double inf = std::numeric_limits<double>::infinity();
  for (double t : {1e308, -1e308, inf, -inf}) {
    CHECK(EstimatorGrad(Estimator::kSwishSign, t, 1.0) == 0.0, "swish(%g)", t);
  }
  // The inline approx_sign e'(t) the kernels' loops use is EstimatorGrad
  // rounded to the input's type, bit for bit: edge values, every float of
  // [-1, 1] near the kink points, and random floats and doubles.
  {
    const float fi = std::numeric_limits<float>::infinity();
    std::vector<float> ts = {0.0f,
                             -0.0f,
                             1.0f,
                             -1.0f,
                             0.5f,
                             2.0f,
                             fi,
                             -fi,
                             std::numeric_limits<float>::quiet_NaN(),
                             std::numeric_limits<float>::denorm_min(),
                             std::nextafter(1.0f, 2.0f),
                             std::nextafter(1.0f, 0.0f),
                             -std::nextafter(1.0f, 0.0f)};
    for (float c : {0.0f, 0.5f, 1.0f}) {  // 4096 floats on each side of c
      float up = c, down = c;
      for (int i = 0; i < 4096; ++i) {
        ts.push_back(up = std::nextafter(up, 2.0f));
        ts.push_back(down = std::nextafter(down, -2.0f));
      }
    }
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uf(-1.5f, 1.5f);
    for (int i = 0; i < 200000; ++i) ts.push_back(uf(rng));
    for (float t : ts) {
      const float want =
          static_cast<float>(EstimatorGrad(Estimator::kApproxSign, t, 1.0));
      const float got = tapehook::ApproxSignGrad(t);
      CHECK(std::memcmp(&want, &got, sizeof(float)) == 0,
            "ApproxSignGrad(%.9g) = %.9g, EstimatorGrad %.9g", t, got, want);
    }
    std::uniform_real_distribution<double> ud(-1.5, 1.5);
    for (int i = 0; i < 100000; ++i) {
      const double t = ud(rng);
      const double want = EstimatorGrad(Estimator::kApproxSign, t, 1.0);
      const double got = tapehook::ApproxSignGrad(t);
      CHECK(std::memcmp(&want, &got, sizeof(double)) == 0,
            "ApproxSignGrad(%.17g) = %.17g, EstimatorGrad %.17g", t, got, want);
    }
  }
  for (double t : {-1000.0, -200.0, -3.0, -0.3, 0.1, 0.7, 2.0, 200.0, 1e300}) {
    for (int k = 1; k < 4; ++k) {
      const Estimator est = static_cast<Estimator>(k);
      const double got = EstimatorGrad(est, t, 0.5);
      const double want = RefEst(est, t, 0.5);
      CHECK(std::isfinite(got) &&
                std::fabs(got - want) <= 1e-12 * (1 + std::fabs(want)),
            "estimator %d at %g: %g vs %g", k, t, got, want);
    }
  }
}

// Zero-size batch: nothing to compute, but dw must still be written (as 0).
// The capability query and plan resolution (plan.h): names round-trip, the
// switches take tiers away, AMX takes a stride-2 conv's backprops but not
// its forward and never a double conv, a
// plan that cannot run is refused with a message naming it, and a conv
// without pixels accepts any plan.
void TestPlans() {
  using tapehook::Impl;
  for (Impl impl :
       {Impl::kPortable, Impl::kAvx2, Impl::kAvx512, Impl::kAmx, Impl::kBest}) {
    Impl back = Impl::kPortable;
    CHECK(tapehook::ParseImpl(tapehook::ImplName(impl), &back) && back == impl,
          "plan name '%s' round-trips", tapehook::ImplName(impl));
  }
  Impl unknown;
  CHECK(!tapehook::ParseImpl("fastest", &unknown), "unknown plan rejected");
  ConvShape s;
  s.batch = 2, s.in_h = 9, s.in_w = 9, s.in_c = 16, s.k_h = 3, s.k_w = 3;
  s.out_c = 8;
  tapehook::ComputeConvGeometry(Padding::kSame, 0, 0, 0, 0, &s);
  auto caps = [&](tapehook::ConvOp op, bool binary, bool is_double,
                  const ConvShape& shape) {
    return tapehook::Capabilities(
        tapehook::QueryOf(op, shape, binary, false, is_double));
  };
  const auto fwd = tapehook::ConvOp::kForward;
  const auto dw = tapehook::ConvOp::kBackpropFilter;
  CHECK(tapehook::CanRun(caps(fwd, true, false, s), Impl::kPortable) &&
            !tapehook::CanRun(caps(fwd, true, false, s), Impl::kAmx),
        "the bitpacked forward runs portable, never AMX");
  CHECK(tapehook::CanRun(caps(fwd, true, false, s), Impl::kAvx512) ==
            tapehook::cpu::Avx512(),
        "avx512 offered exactly where cpu::Avx512()");
  CHECK(tapehook::CanRun(caps(dw, true, false, s), Impl::kAmx) ==
            tapehook::amx::Usable(),
        "AMX offered for a stride-1 float dW exactly where usable");
  CHECK(!tapehook::CanRun(caps(dw, true, true, s), Impl::kAmx),
        "no AMX for double");
  ConvShape strided = s;
  strided.stride_h = strided.stride_w = 2;
  tapehook::ComputeConvGeometry(Padding::kSame, 0, 0, 0, 0, &strided);
  CHECK(tapehook::CanRun(caps(dw, true, false, strided), Impl::kAmx) ==
            tapehook::amx::Usable(),
        "AMX offered for a stride-2 dW (by phases) exactly where usable");
  CHECK(tapehook::CanRun(
            caps(tapehook::ConvOp::kBackpropInput, false, false, strided),
            Impl::kAmx) == tapehook::amx::Usable(),
        "AMX offered for a stride-2 dX (by phases) exactly where usable");
  CHECK(!tapehook::CanRun(caps(fwd, false, false, strided), Impl::kAmx),
        "no AMX for a stride-2 forward");
  tapehook::cpu::SetSwitchesForTest({false, false, /*no_avx2=*/true});
  for (auto op : {fwd, tapehook::ConvOp::kBackpropInput, dw}) {
    CHECK(caps(op, true, false, s) == 1u, "only portable with no AVX2");
  }
  Impl impl = Impl::kAvx2;
  const std::string err = tapehook::ResolvePlan(
      tapehook::QueryOf(fwd, s, true, false, false), &impl);
  CHECK(err.find("plan 'avx2' cannot run") != std::string::npos &&
            err.find("it can run: portable") != std::string::npos,
        "refusal names the plan and what can run: %s", err.c_str());
  ConvShape empty = s;
  empty.batch = 0;
  impl = Impl::kAvx2;
  CHECK(tapehook::ResolvePlan(tapehook::QueryOf(fwd, empty, true, false, false),
                              &impl)
                .empty() &&
            impl == Impl::kPortable,
        "an empty conv accepts any plan");
  impl = Impl::kBest;
  CHECK(
      tapehook::ResolvePlan(tapehook::QueryOf(dw, s, true, false, false), &impl)
              .empty() &&
          impl == Impl::kPortable,
      "'' resolves to the best");
  tapehook::cpu::ClearSwitchesForTest();
}

void TestEmptyBatch() {
  ConvShape s;
  s.batch = 0, s.in_h = s.in_w = 5, s.in_c = 3, s.k_h = s.k_w = 3, s.out_c = 4;
  CHECK(tapehook::ComputeConvGeometry(Padding::kSame, 0, 0, 0, 0, &s).empty(),
        "geometry");
  std::vector<float> w(3 * 3 * 3 * 4, 0.25f);
  std::vector<float> dw = NaNs<float>(w.size());
  for (const NamedFor& f : AllFors()) {
    tapehook::BinaryConv2DForward<float>(s, nullptr, w.data(), true,
                                         Scale::kMeanAbs, nullptr, f.pf);
    tapehook::BinaryConv2DBackpropInput<float>(s, nullptr, w.data(), nullptr,
                                               Estimator::kSteSign, 1.0,
                                               Scale::kMeanAbs, nullptr, f.pf);
    tapehook::BinaryConv2DBackpropFilter<float>(
        s, nullptr, w.data(), nullptr, Estimator::kSteSign, Estimator::kSteSign,
        1.0, Scale::kMeanAbs, dw.data(), f.pf);
    bool zeros = true;
    for (float v : dw) zeros &= v == 0.0f;
    CHECK(zeros, "dw for an empty batch must be 0 [%s]", f.name);
  }
}

// The fully binary forward has three tiers of inner loops (AVX-512
// VPOPCNTDQ, AVX2, portable), picked per call from the CPU and the
// TAPEHOOK_NO_AVX512 / TAPEHOOK_NO_AVX2 variables. Each must match the
// reference, and all must agree bitwise (they compute the same integer dot
// products and the same alpha). Channel counts straddle the 64-bit words and
// the 8 / 32-channel register tiles; shapes mix padding modes, strides,
// dilations and enough pixels for several blocks with ragged row tiles. The
// last cases have inputs of over 2^18 values, which the AVX-512 tier packs
// band by band inside its units (1x1 convs block by block, at any size). x
// also holds -0 (sign +1) and NaN (sign -1, as !(x >= 0)). On a CPU without
// AVX-512 (or AVX2) the forced-off tiers just repeat the next one down.
void TestBitpackedTiers() {
  struct Tier {
    const char* name;
    bool no_avx512, no_avx2;
  };
  const Tier tiers[] = {{"cpu best", false, false},
                        {"TAPEHOOK_NO_AVX512=1", true, false},
                        {"TAPEHOOK_NO_AVX2=1", false, true}};
  auto set_tier = [](const Tier& t) {
    tapehook::cpu::SetSwitchesForTest(
        {/*no_amx=*/false, t.no_avx512, t.no_avx2});
  };
  constexpr int kSmallCases = 60, kLargeCases = 10, kPointwiseCases = 24;
  // Run layouts (k_h, k_w, in_c, dil_w) at and around those the AVX-512
  // tier's short-row kernels take (1 run of <= 8 words, 3 of 3, 9 of 1):
  // 2 runs of 19 words, 1 run of 9, 9 runs of 1, 3 runs of 6, 2 runs of 2.
  constexpr int64_t kLayouts[][4] = {{2, 1, 1216, 1},
                                     {1, 1, 576, 1},
                                     {3, 3, 64, 2},
                                     {3, 3, 128, 1},
                                     {2, 2, 64, 1}};
  constexpr int kLayoutCases = sizeof(kLayouts) / sizeof(kLayouts[0]);
  // The last case repeats the first layout (38 words a row) with every
  // sign of x against every sign of W: each popcount step adds its most, the
  // case that overflows a byte counter flushed too late.
  constexpr int kCases =
      kSmallCases + kLargeCases + kPointwiseCases + kLayoutCases + 1;
  std::mt19937_64 rng(20250301);
  int passed = 0;
  for (int i = 0; i < kCases; ++i) {
    const bool large = i >= kSmallCases && i < kSmallCases + kLargeCases;
    // 1x1 convs without padding: 1 to 10 words of channels (the AVX-512
    // tier keeps up to 8 words of W in registers, more take the tiles).
    const int first_layout = kSmallCases + kLargeCases + kPointwiseCases;
    const bool pointwise = i >= kSmallCases + kLargeCases && i < first_layout;
    const bool saturated = i == kCases - 1;
    const int64_t* layout = saturated           ? kLayouts[0]
                            : i >= first_layout ? kLayouts[i - first_layout]
                                                : nullptr;
    Problem pr;
    pr.act_est = Estimator::kSteSign;
    pr.w_est = Estimator::kSteSign;
    pr.scale = i % 2 ? Scale::kMeanAbs : Scale::kNone;
    pr.clip = 1.0;
    ConvShape& s = pr.s;
    while (true) {
      s = ConvShape();
      s.batch = Pick<int64_t>(rng, {1, 2});
      s.in_c = large ? Pick<int64_t>(rng, {65, 130, 200})
                     : Pick<int64_t>(rng, {1, 63, 64, 65, 130, 200});
      s.out_c = large
                    ? Pick<int64_t>(rng, {1, 9, 33, 40})
                    : Pick<int64_t>(rng, {1, 7, 8, 9, 20, 31, 33, 50, 64, 100});
      const int kernel = Pick<int>(rng, {0, 1, 1, 2, 3, 4});
      const int64_t kh[] = {1, 3, 2, 3, 5}, kw[] = {1, 3, 3, 1, 5};
      s.k_h = kh[kernel], s.k_w = kw[kernel];
      s.stride_h = Pick<int64_t>(rng, {1, 1, 2});
      s.stride_w = Pick<int64_t>(rng, {1, 1, 2});
      s.dil_h = Pick<int64_t>(rng, {1, 1, 2});
      s.dil_w = Pick<int64_t>(rng, {1, 1, 2});
      std::uniform_int_distribution<int64_t> size(large ? 20 : 1,
                                                  large ? 36 : 13);
      std::uniform_int_distribution<int64_t> pad(0, 2);
      s.in_h = size(rng), s.in_w = size(rng);
      while (large && s.batch * s.in_h * s.in_w * s.in_c < (1 << 18)) {
        ++s.batch;
      }
      if (pointwise) {
        s.in_c =
            Pick<int64_t>(rng, {1, 64, 100, 192, 256, 300, 449, 512, 513, 640});
        s.out_c = Pick<int64_t>(rng, {1, 7, 16, 17, 33, 40, 64, 100});
        s.k_h = s.k_w = 1;
        s.dil_h = s.dil_w = 1;
        s.in_h = size(rng) + 4, s.in_w = size(rng) + 4;
      }
      if (layout != nullptr) {
        s.k_h = layout[0], s.k_w = layout[1], s.in_c = layout[2];
        s.dil_h = 1, s.dil_w = layout[3];
        s.stride_h = s.stride_w = 1;
        s.in_h = size(rng) + 6, s.in_w = size(rng) + 6;
      }
      const Padding padding =
          pointwise ? Pick<Padding>(rng, {Padding::kSame, Padding::kValid})
                    : Pick<Padding>(rng, {Padding::kSame, Padding::kValid,
                                          Padding::kExplicit});
      if (tapehook::ComputeConvGeometry(padding, pad(rng), pad(rng), pad(rng),
                                        pad(rng), &s)
              .empty()) {
        break;
      }
    }
    pr.x.resize(s.batch * s.in_h * s.in_w * s.in_c);
    pr.w.resize(s.k_h * s.k_w * s.in_c * s.out_c);
    std::uniform_real_distribution<double> u(0, 1);
    for (double& v : pr.x) {
      const double r = u(rng);
      v = r < 0.03   ? -0.0
          : r < 0.05 ? std::numeric_limits<double>::quiet_NaN()
                     : Value(rng, pr.clip);
    }
    for (double& v : pr.w) v = u(rng) < 0.03 ? -0.0 : Value(rng, pr.clip);
    if (saturated) {
      std::fill(pr.x.begin(), pr.x.end(), -0.5);
      std::fill(pr.w.begin(), pr.w.end(), 0.25);
    }
    const Ref y_ref = RefForward(pr);
    const bool is_float = layout != nullptr || i % 4 != 3;
    bool ok = true;
    // An output transform (OutputAffine, an inference batch norm folded in)
    // on the packed-filter entry point: multiplier * relu?(y) + offset.
    std::vector<double> multiplier(s.out_c), offset(s.out_c);
    for (int64_t o = 0; o < s.out_c; ++o) {
      multiplier[o] = (u(rng) < 0.2 ? -1 : 1) * (0.1 + 2 * u(rng));
      offset[o] = 4 * u(rng) - 2;
    }
    const bool relu = i % 3 == 1;
    auto run = [&](auto zero) {
      using T = decltype(zero);
      const std::vector<T> x = Cast<T>(pr.x), w = Cast<T>(pr.w);
      const std::vector<T> m = Cast<T>(multiplier), b = Cast<T>(offset);
      const tapehook::OutputAffine<T> affine{m.data(), b.data(), relu};
      const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-13;
      std::vector<T> y0, a0;
      for (const Tier& tier : tiers) {
        set_tier(tier);
        for (const NamedFor& f : AllFors()) {
          const std::string tag =
              std::string(" [") + tier.name + ", " + f.name + "]";
          std::vector<T> y = NaNs<T>(y_ref.val.size());
          tapehook::BinaryConv2DForward<T>(s, x.data(), w.data(),
                                           /*binary_input=*/true, pr.scale,
                                           y.data(), f.pf);
          ok &= Matches("bitpacked forward" + tag, y, y_ref);
          if (y0.empty()) {
            y0 = y;
          } else if (!BitwiseEqual(y.data(), y0.data(), y.size() * sizeof(T))) {
            std::printf(
                "  bitpacked forward%s differs bitwise from the "
                "first tier\n",
                tag.c_str());
            ok = false;
          }
          const tapehook::BitFilter<T> filter =
              tapehook::PackBitFilter<T>(s, w.data(), pr.scale, f.pf);
          std::vector<T> a = NaNs<T>(y.size());
          tapehook::BinaryConv2DForwardBinary<T>(s, x.data(), filter, a.data(),
                                                 f.pf, &affine);
          for (size_t k = 0; k < a.size(); ++k) {
            const int64_t o = static_cast<int64_t>(k) % s.out_c;
            const double pre =
                relu ? std::max(0.0, static_cast<double>(y[k])) : y[k];
            const double want = multiplier[o] * pre + offset[o];
            const double bound = tol * (std::fabs(multiplier[o] * pre) +
                                        std::fabs(offset[o]) + 1);
            if (!(std::fabs(a[k] - want) <= bound)) {
              std::printf("  affine forward%s at %zu: %.9g, want %.9g\n",
                          tag.c_str(), k, static_cast<double>(a[k]), want);
              ok = false;
              break;
            }
          }
          if (a0.empty()) {
            a0 = a;
          } else if (!BitwiseEqual(a.data(), a0.data(), a.size() * sizeof(T))) {
            std::printf("  affine forward%s differs bitwise from the first\n",
                        tag.c_str());
            ok = false;
          }
          // With an addend (a residual add folded in): the transform's output
          // plus the addend in T, to the bit, also written in place over the
          // addend.
          std::vector<T> addend(a.size());
          for (T& v : addend) v = static_cast<T>(4 * u(rng) - 2);
          tapehook::OutputAffine<T> with_add = affine;
          with_add.addend = addend.data();
          std::vector<T> sum = NaNs<T>(a.size());
          tapehook::BinaryConv2DForwardBinary<T>(s, x.data(), filter,
                                                 sum.data(), f.pf, &with_add);
          std::vector<T> in_place = addend;
          with_add.addend = in_place.data();
          tapehook::BinaryConv2DForwardBinary<T>(
              s, x.data(), filter, in_place.data(), f.pf, &with_add);
          for (size_t k = 0; k < a.size(); ++k) {
            const T want = a[k] + addend[k];
            if (!BitwiseEqual(&sum[k], &want, sizeof(T)) ||
                !BitwiseEqual(&in_place[k], &want, sizeof(T))) {
              std::printf(
                  "  affine + addend forward%s at %zu: %.9g / %.9g in place, "
                  "want %.9g\n",
                  tag.c_str(), k, static_cast<double>(sum[k]),
                  static_cast<double>(in_place[k]), static_cast<double>(want));
              ok = false;
              break;
            }
          }
        }
      }
    };
    if (is_float) {
      run(0.0f);
    } else {
      run(0.0);
    }
    CHECK(ok, "bitpacked forward tiers, case %d: %s", i,
          Describe(pr, is_float).c_str());
    passed += ok;
  }
  tapehook::cpu::ClearSwitchesForTest();
  std::printf("binary_conv [bitpacked forward, 3 tiers]: %d/%d cases passed\n",
              passed, kCases);
}

// The sign-table backprops against the reference and the portable plan,
// through the public entry points of binary_conv.h and packed_backprop.h:
// plan avx512 (lut_backprop.h, dX and dW) and plan avx2 (its dW of a binary
// input is lut_backprop_avx2.h; its dX the GEMM, checked against the
// reference only). Shapes cover
// what the engine pads or tiles internally: channel counts off the 16 lanes
// (1, 3, 15, 17, 33, 100) and on them (16, 64), strides 1 to 3, kernels 1x1,
// 3x3, 5x5 and 2x3, SAME / VALID / explicit padding (taps that never meet
// the input included), batch 1 and 3, odd image sizes; every activation and
// weight estimator, alpha on and off. Each result must match the reference
// within the float tolerance, agree bitwise under every ParallelFor, and
// the packed-input backprops must give the float-input ones' bits.
void TestTableBackprops(tapehook::Impl plan) {
  using tapehook::Impl;
  const bool avx512 = plan == Impl::kAvx512;
  const char* plan_name = tapehook::ImplName(plan);
  if (avx512 ? !tapehook::cpu::Avx512() : !tapehook::cpu::Avx2()) {
    std::printf(
        "binary_conv [%s backprops]: skipped (not on this CPU or a "
        "TAPEHOOK_NO_* switch set)\n",
        plan_name);
    return;
  }
  const int64_t kChannels[] = {1, 3, 15, 16, 17, 33, 64, 100};
  const int64_t kKernels[][2] = {{1, 1}, {3, 3}, {5, 5}, {2, 3}};
  // Then larger fixed shapes: several dX passes over output channel groups
  // and row-band jobs, several dW position chunks and channel slices, whole
  // image dX jobs; batches of several groups of images (the AVX2 dW tables
  // sum 4 images, the last group part empty).
  // {batch, h, w, in_c, out_c, k, stride, padding}.
  const int64_t kLarge[][8] = {{2, 20, 21, 64, 160, 3, 1, 0},
                               {1, 29, 27, 48, 130, 5, 2, 0},
                               {4, 9, 9, 96, 40, 3, 2, 1},
                               {9, 7, 6, 20, 27, 3, 1, 0},
                               {6, 9, 8, 17, 40, 3, 2, 1}};
  constexpr int kRandomCases = 96;
  constexpr int kCases = kRandomCases + 5;
  std::mt19937_64 rng(20260417);
  int passed = 0;
  for (int i = 0; i < kCases; ++i) {
    Problem pr;
    // Coprime strides over the enumerations so that they meet every mix.
    const Estimator acts[] = {Estimator::kSteSign, Estimator::kApproxSign,
                              Estimator::kSwishSign, Estimator::kNone};
    pr.act_est = acts[i % 4];
    pr.w_est = static_cast<Estimator>(i / 4 % 4);
    pr.scale = i % 3 == 1 ? Scale::kNone : Scale::kMeanAbs;
    pr.clip = i % 5 == 2 ? 0.5 : 1.0;
    ConvShape& s = pr.s;
    while (i >= kRandomCases) {
      const int64_t* l = kLarge[i - kRandomCases];
      s = ConvShape();
      s.batch = l[0], s.in_h = l[1], s.in_w = l[2], s.in_c = l[3];
      s.out_c = l[4], s.k_h = s.k_w = l[5], s.stride_h = s.stride_w = l[6];
      CHECK(tapehook::ComputeConvGeometry(static_cast<Padding>(l[7]), 0, 0, 0,
                                          0, &s)
                .empty(),
            "large table backprop shape %d", i - kRandomCases);
      break;
    }
    while (i < kRandomCases) {
      s = ConvShape();
      s.in_c = kChannels[i % 8];
      s.out_c = kChannels[(3 * i + i / 8) % 8];
      s.k_h = kKernels[i % 7 % 4][0], s.k_w = kKernels[i % 7 % 4][1];
      s.batch = i % 2 ? 3 : 1;
      s.stride_h = Pick<int64_t>(rng, {1, 1, 2, 3});
      s.stride_w = i % 6 == 5 ? s.stride_h : Pick<int64_t>(rng, {1, 2, 2, 3});
      std::uniform_int_distribution<int64_t> size(1, 13);
      s.in_h = size(rng) | 1, s.in_w = size(rng);
      const Padding padding = static_cast<Padding>(i % 3);
      std::uniform_int_distribution<int64_t> pad(0, 3);
      if (!tapehook::ComputeConvGeometry(padding, pad(rng), pad(rng), pad(rng),
                                         pad(rng), &s)
               .empty()) {
        continue;
      }
      // Keeps the naive reference (and the sanitizer run) quick.
      if (s.batch * s.out_h * s.out_w * s.k_h * s.k_w * s.in_c * s.out_c <=
          4000000) {
        break;
      }
    }
    pr.x.resize(s.batch * s.in_h * s.in_w * s.in_c);
    pr.w.resize(s.k_h * s.k_w * s.in_c * s.out_c);
    pr.dy.resize(s.batch * s.out_h * s.out_w * s.out_c);
    std::uniform_real_distribution<double> u(-1, 1);
    // -0 has sign +1, as 0 does.
    for (double& v : pr.x) v = u(rng) < -0.95 ? -0.0 : Value(rng, pr.clip);
    for (double& v : pr.w) v = u(rng) < -0.95 ? -0.0 : Value(rng, pr.clip);
    for (double& v : pr.dy) v = static_cast<float>(u(rng));
    const std::vector<float> x = Cast<float>(pr.x), w = Cast<float>(pr.w),
                             dy = Cast<float>(pr.dy);
    const bool binary = pr.act_est != Estimator::kNone;
    const Ref dx_ref = RefBackpropInput(pr), dw_ref = RefBackpropFilter(pr);
    bool ok = true;
    auto offered = [&](tapehook::ConvOp op, bool packed) {
      return tapehook::CanRun(tapehook::Capabilities(tapehook::QueryOf(
                                  op, s, binary || packed, packed, false)),
                              plan);
    };
    ok &= offered(tapehook::ConvOp::kBackpropInput, false);
    ok &= offered(tapehook::ConvOp::kBackpropInput, true);
    ok &= offered(tapehook::ConvOp::kBackpropFilter, true);
    // avx2 runs every float dW (its GEMM where x is not binary).
    ok &= offered(tapehook::ConvOp::kBackpropFilter, false) ==
          (binary || !avx512);
    if (!ok) std::printf("  %s not offered where it should be\n", plan_name);
    // The engine itself takes the conv (no silent fallback inside the plan).
    std::vector<float> raw(x.size());
    std::vector<float> raw_w(w.size());
    if (avx512) {
      ok &= tapehook::lut::BackpropInput(s, w.data(), nullptr, dy.data(),
                                         raw.data(), InlineFor);
      ok &= tapehook::lut::BackpropFilter(s, x.data(), dy.data(), raw_w.data(),
                                          InlineFor);
    } else {
      ok &= tapehook::lut_avx2::BackpropFilter(s, x.data(), dy.data(),
                                               raw_w.data(), InlineFor);
    }
    if (!ok) std::printf("  the %s engine refused the conv\n", plan_name);
    // The packed backprops always apply the ste_sign mask.
    const bool ste = pr.act_est == Estimator::kSteSign;
    Problem packed_pr = pr;
    packed_pr.act_est = Estimator::kSteSign;
    const Ref dx_packed_ref = ste ? dx_ref : RefBackpropInput(packed_pr);
    const Ref dw_packed_ref = ste ? dw_ref : RefBackpropFilter(packed_pr);
    std::vector<uint8_t> packed(s.batch * s.in_h * s.in_w *
                                tapehook::PackedBytes(s.in_c));
    tapehook::PackSignMask(x.data(), s.batch * s.in_h * s.in_w, s.in_c, pr.clip,
                           packed.data(), InlineFor);
    std::vector<float> dx0, dw0;
    for (const NamedFor& f : AllFors()) {
      const std::string tag = std::string(" [") + f.name + "]";
      for (Impl impl : {plan, Impl::kPortable}) {
        const std::string name = std::string(tapehook::ImplName(impl)) + tag;
        std::vector<float> dx = NaNs<float>(x.size());
        tapehook::BinaryConv2DBackpropInput<float>(
            s, x.data(), w.data(), dy.data(), pr.act_est, pr.clip, pr.scale,
            dx.data(), f.pf, impl);
        ok &= Matches("backprop_input " + name, dx, dx_ref);
        std::vector<float> dw = NaNs<float>(w.size());
        tapehook::BinaryConv2DBackpropFilter<float>(
            s, x.data(), w.data(), dy.data(), pr.act_est, pr.w_est, pr.clip,
            pr.scale, dw.data(), f.pf, impl);
        ok &= Matches("backprop_filter " + name, dw, dw_ref);
        std::vector<float> pdx = NaNs<float>(x.size());
        tapehook::BinaryConv2DBackpropInputPacked<float>(
            s, packed.data(), w.data(), dy.data(), pr.clip, pr.scale,
            pdx.data(), f.pf, impl);
        ok &= Matches("packed backprop_input " + name, pdx, dx_packed_ref);
        std::vector<float> pdw = NaNs<float>(w.size());
        tapehook::BinaryConv2DBackpropFilterPacked<float>(
            s, packed.data(), w.data(), dy.data(), pr.w_est, pr.clip, pr.scale,
            pdw.data(), f.pf, impl);
        ok &= Matches("packed backprop_filter " + name, pdw, dw_packed_ref);
        if (impl != plan) continue;
        // Plan avx2's dX is the GEMM on the float input (on a stand-in for
        // packed bits): its bits are not the table engine's to promise.
        if (ste &&
            ((avx512 && !BitwiseEqual(pdx.data(), dx.data(), 4 * dx.size())) ||
             !BitwiseEqual(pdw.data(), dw.data(), 4 * dw.size()))) {
          std::printf("  packed%s differs bitwise from the float input\n",
                      tag.c_str());
          ok = false;
        }
        if (dx0.empty()) {
          dx0 = dx, dw0 = dw;
        } else if ((avx512 &&
                    !BitwiseEqual(dx.data(), dx0.data(), 4 * dx.size())) ||
                   (binary &&
                    !BitwiseEqual(dw.data(), dw0.data(), 4 * dw.size()))) {
          std::printf("  %s%s differs bitwise from [inline]\n", plan_name,
                      tag.c_str());
          ok = false;
        }
      }
    }
    CHECK(ok, "%s backprops, case %d: %s", plan_name, i,
          Describe(pr, /*is_float=*/true).c_str());
    passed += ok;
  }
  std::printf("binary_conv [%s backprops vs portable]: %d/%d cases passed\n",
              plan_name, passed, kCases);
}

// The avx512 plan's scope for the backprops: float only, dilation 1, dW only
// with a binary input, at most lut::kMaxTaps taps; unknown sizes and any
// channel count never exclude it; TAPEHOOK_NO_AVX512 takes it away.
void TestAvx512BackpropPlans() {
  using tapehook::ConvOp;
  using tapehook::ConvQuery;
  using tapehook::Impl;
  const bool avx512 = tapehook::cpu::Avx512();
  auto offered = [](const ConvQuery& q) {
    return tapehook::CanRun(tapehook::Capabilities(q), Impl::kAvx512);
  };
  ConvQuery q;
  q.op = ConvOp::kBackpropInput;
  q.k_h = q.k_w = 3;
  CHECK(offered(q) == avx512, "dX with unknown sizes");
  q.in_c = 3, q.out_c = 100;
  CHECK(offered(q) == avx512, "dX with 3 -> 100 channels");
  q.packed_input = q.binary_input = true;
  CHECK(offered(q) == avx512, "packed dX");
  q.is_double = true;
  CHECK(!offered(q), "no avx512 backprop for double");
  q.is_double = false;
  q.dil_h = 2;
  CHECK(!offered(q), "no avx512 backprop with dilation 2");
  q.dil_h = 1;
  q.k_h = 5, q.k_w = 7;
  CHECK(!offered(q), "no avx512 backprop with 35 taps");
  q.k_h = q.k_w = 5;
  q.stride_h = q.stride_w = 3;
  CHECK(offered(q) == avx512, "dX 5x5 stride 3");
  q.op = ConvOp::kBackpropFilter;
  CHECK(offered(q) == avx512, "dW of a binary input");
  q.binary_input = q.packed_input = false;
  CHECK(!offered(q), "no avx512 dW of a float input");
  q.binary_input = true;
  if (avx512) {
    CHECK(tapehook::SelectBest(tapehook::Capabilities(q)) ==
              (tapehook::amx::Usable() && tapehook::amx::Supports(q)
                   ? Impl::kAmx
                   : Impl::kAvx512),
          "avx512 is the best backprop plan without AMX");
  }
  tapehook::cpu::SetSwitchesForTest({false, /*no_avx512=*/true, false});
  CHECK(!offered(q), "TAPEHOOK_NO_AVX512 takes the avx512 backprops away");
  tapehook::cpu::ClearSwitchesForTest();
}

// Runs the random sweep once; returns the number of failed cases.
int RunSweep(const char* isa) {
  constexpr int kCases = 320;
  std::mt19937_64 rng(20240611);
  int failed = 0;
  for (int i = 0; i < kCases; ++i) {
    bool is_float = true;
    const Problem pr = RandomProblem(rng, i, &is_float);
    const bool ok = is_float ? RunCase<float>(pr) : RunCase<double>(pr);
    if (ok) {
      ++g_stats.passed;
    } else {
      ++failed;
      std::printf("FAIL [%s] case %d: %s\n", isa, i,
                  Describe(pr, is_float).c_str());
    }
  }
  std::printf("binary_conv [%s]: %d/%d sweep cases passed\n", isa,
              kCases - failed, kCases);
  return failed;
}

// ---------------------------------------------------------------------------
// The one-byte max pool (max_pool.h) against loops from its definition:
// the first in-image tap in row-major order, a later one only where strictly
// greater; dx = MaxPoolGrad's sum in output order, then with relu ReluGrad's
// product by (r > 0) at every position; the gather reads ReluGrad(v) at the
// maximum. Bitwise, zero signs and NaNs included, under every ParallelFor.

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void TestMaxPoolTapsCase(ConvShape s, bool same, bool relu,
                         std::mt19937_64& rng) {
  s.in_c = s.out_c = 1;
  const std::string problem = tapehook::ComputeConvGeometry(
      same ? Padding::kSame : Padding::kValid, 0, 0, 0, 0, &s);
  CHECK(problem.empty(), "%s", problem.c_str());
  s.in_c = s.out_c = 1 + static_cast<int64_t>(rng() % 37);
  const int64_t c = s.in_c;
  const int64_t in_size = s.batch * s.in_h * s.in_w * c;
  const int64_t out_size = s.batch * s.out_h * s.out_w * c;
  // Halves in [-2, 2] (ties, zeros, -0.0), a few NaN and -inf; a ReLU's
  // output where relu.
  std::vector<float> x(in_size), dy(out_size), v(in_size);
  for (float& t : x) {
    const int64_t r = static_cast<int64_t>(rng() % 40);
    t = r == 0   ? std::numeric_limits<float>::quiet_NaN()
        : r == 1 ? -std::numeric_limits<float>::infinity()
        : r == 2 ? -0.0f
                 : static_cast<float>(static_cast<int64_t>(rng() % 9) - 4) / 2;
    if (relu) t = t > 0.0f ? t : (std::isnan(t) ? t : 0.0f);
  }
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& t : dy) t = u(rng);
  for (float& t : v) t = u(rng);
  // The reference.
  std::vector<float> want_y(out_size), want_dx(in_size, 0.0f),
      want_gather(out_size, 0.0f);
  std::vector<int64_t> at(out_size, -1);
  for (int64_t n = 0; n < s.batch; ++n)
    for (int64_t oh = 0; oh < s.out_h; ++oh)
      for (int64_t ow = 0; ow < s.out_w; ++ow)
        for (int64_t k = 0; k < c; ++k) {
          const int64_t o = ((n * s.out_h + oh) * s.out_w + ow) * c + k;
          for (int64_t i = 0; i < s.k_h; ++i)
            for (int64_t j = 0; j < s.k_w; ++j) {
              const int64_t ih = oh * s.stride_h - s.pad_top + i;
              const int64_t iw = ow * s.stride_w - s.pad_left + j;
              if (ih < 0 || ih >= s.in_h || iw < 0 || iw >= s.in_w) continue;
              const int64_t p = ((n * s.in_h + ih) * s.in_w + iw) * c + k;
              if (at[o] < 0 || x[at[o]] < x[p]) at[o] = p;
            }
          want_y[o] = x[at[o]];
          want_dx[at[o]] += dy[o];
        }
  std::vector<float> read = v;  // ReluGrad(v) where relu
  for (int64_t p = 0; relu && p < in_size; ++p) {
    const float live = x[p] > 0.0f ? 1.0f : 0.0f;
    want_dx[p] *= live;
    read[p] *= live;
  }
  for (int64_t o = 0; o < out_size; ++o) want_gather[o] = read[at[o]];
  for (const NamedFor& f : AllFors()) {
    std::vector<float> y(out_size), dx(in_size), gather(out_size);
    std::vector<int8_t> taps(out_size);
    tapehook::MaxPoolTaps(s, x.data(), relu, y.data(), taps.data(), f.pf);
    CHECK(SameBits(y, want_y), "MaxPoolTaps y [%s]", f.name);
    CHECK(tapehook::MaxPoolTapsBackprop(s, dy.data(), taps.data(), relu,
                                        dx.data(), f.pf),
          "valid taps rejected [%s]", f.name);
    CHECK(SameBits(dx, want_dx), "MaxPoolTapsBackprop relu=%d [%s]", relu,
          f.name);
    CHECK(tapehook::MaxPoolTapsGather(s, v.data(), taps.data(), relu,
                                      gather.data(), f.pf),
          "valid taps rejected [%s]", f.name);
    CHECK(SameBits(gather, want_gather), "MaxPoolTapsGather relu=%d [%s]", relu,
          f.name);
    // A tap beyond its window, or (SAME) in the padding: false, no write
    // outside dx (the sanitizer run would see it).
    for (const int8_t bad :
         {static_cast<int8_t>(s.k_h * s.k_w), static_cast<int8_t>(127),
          static_cast<int8_t>(~(s.k_h * s.k_w))}) {
      std::vector<int8_t> wrong = taps;
      wrong[out_size - 1] = bad;
      CHECK(!tapehook::MaxPoolTapsBackprop(s, dy.data(), wrong.data(), relu,
                                           dx.data(), f.pf),
            "tap %d accepted [%s]", bad, f.name);
      CHECK(!tapehook::MaxPoolTapsGather(s, v.data(), wrong.data(), relu,
                                         gather.data(), f.pf),
            "tap %d accepted [%s]", bad, f.name);
    }
  }
}

void TestMaxPoolTaps() {
  std::mt19937_64 rng(19);
  struct Case {
    int64_t batch, in_h, in_w, k_h, k_w, stride_h, stride_w;
    bool same;
  };
  const Case cases[] = {
      {2, 13, 11, 3, 3, 2, 2, true},  {1, 12, 12, 2, 2, 2, 2, false},
      {2, 9, 10, 3, 2, 1, 2, true},   {1, 7, 8, 4, 4, 3, 3, true},
      {3, 5, 5, 5, 5, 1, 1, false},   {1, 6, 6, 1, 1, 2, 2, true},
      {2, 8, 8, 3, 3, 1, 1, true},    {1, 16, 16, 11, 11, 5, 5, true},
      {1, 3, 20, 1, 20, 1, 1, false},
  };
  const tapehook::cpu::Switches env = tapehook::cpu::FromEnvironment();
  for (const bool no_simd : {false, true}) {
    tapehook::cpu::SetSwitchesForTest(
        {env.no_amx, no_simd || env.no_avx512, no_simd || env.no_avx2});
    for (const Case& k : cases) {
      for (const bool relu : {false, true}) {
        ConvShape s;
        s.batch = k.batch;
        s.in_h = k.in_h;
        s.in_w = k.in_w;
        s.k_h = k.k_h;
        s.k_w = k.k_w;
        s.stride_h = k.stride_h;
        s.stride_w = k.stride_w;
        TestMaxPoolTapsCase(s, k.same, relu, rng);
      }
    }
  }
  tapehook::cpu::ClearSwitchesForTest();
  std::printf("max_pool taps: %zu cases x relu x tiers, %d failures so far\n",
              sizeof(cases) / sizeof(cases[0]), g_failures);
}
}  // namespace

int main() {
  TestGeometry();
  TestMaxPoolTaps();
  TestParsingAndEstimators();
  TestEmptyBatch();
  TestPlans();
  TestBitpackedTiers();
  TestAvx512BackpropPlans();
  TestTableBackprops(tapehook::Impl::kAvx512);
  TestTableBackprops(tapehook::Impl::kAvx2);

  // The core picks AVX2 kernels at run time when the CPU has them, unless
  // TAPEHOOK_NO_AVX2 is set: sweep with the CPU's best ISA, then with the
  // portable fallback forced.
  const tapehook::cpu::Switches env = tapehook::cpu::FromEnvironment();
  int failed = RunSweep(env.no_avx2 ? "portable (TAPEHOOK_NO_AVX2 set)"
                                    : "cpu best (AMX / AVX2 if supported)");
  if (tapehook::amx::Usable()) {  // the float kernels once more without AMX
    tapehook::cpu::SetSwitchesForTest({/*no_amx=*/true, env.no_avx512, false});
    failed += RunSweep("no AMX (TAPEHOOK_NO_AMX=1)");
  }
  tapehook::cpu::SetSwitchesForTest({false, false, /*no_avx2=*/true});
  TestEmptyBatch();
  failed += RunSweep("portable");
  tapehook::cpu::ClearSwitchesForTest();
  g_stats.failed = failed;
  std::printf(
      "binary_conv: %d sweep cases passed, %d failed; %d other check "
      "failures; max |err|/sum|terms| float %.3g double %.3g\n",
      g_stats.passed, failed, g_failures, g_stats.max_err[0],
      g_stats.max_err[1]);
  return failed == 0 && g_failures == 0 ? 0 : 1;
}
