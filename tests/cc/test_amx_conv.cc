// Standalone test of the AMX kernels' exactness (cc_kernels/core/amx_conv.h),
// no TensorFlow. test_binary_conv.cc checks every kernel against naive loops
// within a tolerance; this checks the claim that makes the AMX path exact:
// splitting a float into three bf16 parts loses nothing. A single-product
// convolution (1x1, one input channel or one pixel) must then give the same
// bits as the fp32 product, for floats that use all 24 significand bits and
// a wide range of exponents. A two-part split would be off by up to 2^-16:
// that is the opt-in DySplit::kBf16x2 (tapehook.config backprop_dy="bf16x2"),
// checked against its model and bound.
//
//   g++ -std=c++17 -O2 -I. tests/cc/test_amx_conv.cc cc_kernels/core/*.cc
//       -lpthread -o /tmp/t && /tmp/t
//
// Also: the backprops that read the input as packed sign / mask bits
// (pack_input.h) give the same bits as the float-input ones, with and
// without AMX. Prints "amx: skipped" for the exactness part on CPUs without
// AMX.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "cc_kernels/core/amx_conv.h"
#include "cc_kernels/core/amx_primitives.h"
#include "cc_kernels/core/amx_runtime.h"
#include "cc_kernels/core/binary_conv.h"
#include "cc_kernels/core/cpu.h"
#include "cc_kernels/core/pack_input.h"
#include "cc_kernels/core/packed_backprop.h"

namespace {

using tapehook::ConvShape;
using tapehook::DySplit;
using tapehook::Estimator;

int g_failures = 0;

// The switches of TAPEHOOK_NO_AMX=1, pinned without setenv.
const tapehook::cpu::Switches kNoAmx{/*no_amx=*/true, false, false};

void Check(bool ok, const char* what) {
  if (!ok) {
    ++g_failures;
    std::printf("  FAILED: %s\n", what);
  }
}

const tapehook::ParallelFor kSerial =
    [](int64_t total, int64_t,
       const std::function<void(int64_t, int64_t)>& fn) { fn(0, total); };

// Floats with all 24 significand bits random, exponents in [-40, 40], both
// signs, and a few zeros and negative zeros.
std::vector<float> FullMantissa(std::mt19937_64& rng, size_t n) {
  std::uniform_int_distribution<uint32_t> mant(0, (1u << 23) - 1);
  std::uniform_int_distribution<int> expo(-40, 40), coin(0, 19);
  std::vector<float> v(n);
  for (float& t : v) {
    const int c = coin(rng);
    if (c == 0) {
      t = 0.0f;
    } else if (c == 1) {
      t = -0.0f;
    } else {
      const uint32_t bits = (static_cast<uint32_t>(127 + expo(rng)) << 23) |
                            mant(rng) | (c % 2 ? 0x80000000u : 0u);
      std::memcpy(&t, &bits, 4);
    }
  }
  return v;
}

float SignOf(float t) { return t >= 0 ? 1.0f : -1.0f; }

bool SameBits(float a, float b) {
  return std::memcmp(&a, &b, 4) == 0 || a == b;
}

ConvShape Shape1x1(int64_t batch, int64_t h, int64_t w, int64_t c, int64_t o) {
  ConvShape s;
  s.batch = batch, s.in_h = h, s.in_w = w, s.in_c = c;
  s.k_h = 1, s.k_w = 1, s.out_c = o;
  tapehook::ComputeConvGeometry(tapehook::Padding::kValid, 0, 0, 0, 0, &s);
  return s;
}

// y[p, o] = x[p] * alpha[o] * sign(w[o]): one product per output.
void TestForwardSingleProduct(std::mt19937_64& rng) {
  const ConvShape s = Shape1x1(2, 5, 7, 1, 37);
  const std::vector<float> x = FullMantissa(rng, 2 * 5 * 7);
  const std::vector<float> w = FullMantissa(rng, 37);
  std::vector<float> alpha(37);
  for (int o = 0; o < 37; ++o) alpha[o] = std::abs(w[o]) + 0.5f;
  const float* scales[] = {nullptr, alpha.data()};
  for (const float* a : scales) {
    std::vector<float> y(2 * 5 * 7 * 37, -7.0f);
    Check(tapehook::amx::Forward(s, x.data(), w.data(), a, y.data(), kSerial),
          "amx::Forward took the 1x1 conv");
    int bad = 0;
    for (size_t p = 0; p < x.size(); ++p) {
      for (int o = 0; o < 37; ++o) {
        const float want = x[p] * SignOf(w[o]) * (a ? a[o] : 1.0f);
        bad += !SameBits(y[p * 37 + o], want);
      }
    }
    Check(bad == 0, a ? "forward x * alpha * sign(w) exact"
                      : "forward x * sign(w) exact");
  }
}

// dx[p, c] = dy[p] * alpha * sign(w[c]) [* e'(x)]: no mask, ste_sign's
// 1{|x| <= 1}, approx_sign's 2 - 2|x| (EstimatorGrad rounded to float).
void TestBackpropInputSingleProduct(std::mt19937_64& rng) {
  const ConvShape s = Shape1x1(2, 6, 5, 41, 1);
  const std::vector<float> x = FullMantissa(rng, 2 * 6 * 5 * 41);
  const std::vector<float> w = FullMantissa(rng, 41);
  const std::vector<float> dy = FullMantissa(rng, 2 * 6 * 5);
  const float alpha = 0.8125f + std::abs(w[0]);
  for (Estimator est :
       {Estimator::kNone, Estimator::kSteSign, Estimator::kApproxSign}) {
    std::vector<float> dx(x.size(), -7.0f);
    Check(tapehook::amx::BackpropInput(s, x.data(), w.data(), dy.data(), est,
                                       1.0, &alpha, dx.data(), kSerial),
          "amx::BackpropInput took the 1x1 conv");
    int bad = 0;
    for (size_t p = 0; p < dy.size(); ++p) {
      for (int c = 0; c < 41; ++c) {
        const float mask = static_cast<float>(
            tapehook::EstimatorGrad(est, x[p * 41 + c], 1.0));
        const float want = dy[p] * (alpha * SignOf(w[c])) * mask;
        bad += !SameBits(dx[p * 41 + c], want);
      }
    }
    Check(bad == 0, est == Estimator::kNone ? "backprop-input exact"
                    : est == Estimator::kSteSign
                        ? "backprop-input with mask exact"
                        : "backprop-input approx_sign exact");
  }
}

// A one-pixel 1x1 conv of 45 -> 29 channels: one product per dw element.
struct OnePixel {
  ConvShape s = Shape1x1(1, 1, 1, 45, 29);
  std::vector<float> x, w, dy, alpha;
  explicit OnePixel(std::mt19937_64& rng)
      : x(FullMantissa(rng, 45)),
        w(FullMantissa(rng, 45 * 29)),
        dy(FullMantissa(rng, 29)),
        alpha(29) {
    for (int o = 0; o < 29; ++o) alpha[o] = 0.25f + o / 64.0f;
  }
};

// One pixel: dw[c, o] = x_hat[c] * dy[o] * alpha[o].
void TestBackpropFilterSinglePixel(std::mt19937_64& rng) {
  const OnePixel c1(rng);
  const ConvShape& s = c1.s;
  const std::vector<float>&x = c1.x, &w = c1.w, &dy = c1.dy, &alpha = c1.alpha;
  for (bool binary : {true, false}) {
    std::vector<float> dw(w.size(), -7.0f);
    Check(tapehook::amx::BackpropFilter(
              s, x.data(), w.data(), dy.data(),
              binary ? Estimator::kSteSign : Estimator::kNone, Estimator::kNone,
              1.0, alpha.data(), dw.data(), kSerial),
          "amx::BackpropFilter took the one-pixel conv");
    int bad = 0;
    for (int c = 0; c < 45; ++c) {
      for (int o = 0; o < 29; ++o) {
        const float got = dw[c * 29 + o];
        if (binary) {  // sign * dy is exact: the result is bitwise
          bad += !SameBits(got, (SignOf(x[c]) * dy[o]) * alpha[o]);
        } else {  // six of nine part products: within ~2^-22 relative
          const double want = double(x[c]) * dy[o] * alpha[o];
          bad += std::abs(got - want) > std::ldexp(std::abs(want), -21);
        }
      }
    }
    Check(bad == 0, binary ? "backprop-filter sign(x) * dy exact"
                           : "backprop-filter x * dy within 2^-21");
  }
}

// DySplit::kBf16x2: the backprops split dy into two bf16 parts.
// Single-product convs (as above) then give, bit for bit, the product of the
// scalar two-part split (amx_primitives.h Split2; the GEMMs' rows are split
// by the AVX-512 code), and that is within 2^-16 of the exact product.
void TestTwoPartDy(std::mt19937_64& rng) {
  auto two_part = [](float t) {
    uint16_t hi, mid;
    tapehook::amx::Split2(t, &hi, &mid);
    return tapehook::amx::FromBits(uint32_t{hi} << 16) +
           tapehook::amx::FromBits(uint32_t{mid} << 16);
  };
  int bad = 0, loose = 0;
  {
    const ConvShape s = Shape1x1(2, 6, 5, 41, 1);
    const std::vector<float> x = FullMantissa(rng, 2 * 6 * 5 * 41);
    const std::vector<float> w = FullMantissa(rng, 41);
    const std::vector<float> dy = FullMantissa(rng, 2 * 6 * 5);
    const float alpha = 0.8125f + std::abs(w[0]);
    std::vector<float> dx(x.size(), -7.0f);
    Check(tapehook::amx::BackpropInput(s, x.data(), w.data(), dy.data(),
                                       Estimator::kNone, 1.0, &alpha, dx.data(),
                                       kSerial, DySplit::kBf16x2),
          "amx::BackpropInput took the 1x1 conv (bf16x2)");
    for (size_t p = 0; p < dy.size(); ++p) {
      const float t = dy[p] * alpha;  // dX's A is alpha-scaled dy
      for (int c = 0; c < 41; ++c) {
        const float got = dx[p * 41 + c];
        bad += !SameBits(got, two_part(t) * SignOf(w[c]));
        loose += std::abs(double(got) - double(t) * SignOf(w[c])) >
                 std::ldexp(std::abs(double(t)), -16);
      }
    }
  }
  {
    const OnePixel c1(rng);
    const ConvShape& s = c1.s;
    const std::vector<float>&x = c1.x, &w = c1.w, &dy = c1.dy,
          &alpha = c1.alpha;
    std::vector<float> dw(w.size(), -7.0f);
    Check(tapehook::amx::BackpropFilter(s, x.data(), w.data(), dy.data(),
                                        Estimator::kSteSign, Estimator::kNone,
                                        1.0, alpha.data(), dw.data(), kSerial,
                                        DySplit::kBf16x2),
          "amx::BackpropFilter took the one-pixel conv (bf16x2)");
    for (int c = 0; c < 45; ++c) {
      for (int o = 0; o < 29; ++o) {
        const float got = dw[c * 29 + o];
        bad += !SameBits(got, (SignOf(x[c]) * two_part(dy[o])) * alpha[o]);
        const double exact = double(SignOf(x[c])) * dy[o] * alpha[o];
        loose += std::abs(got - exact) >
                 std::ldexp(std::abs(exact), -16) * (1 + std::ldexp(1.0, -20));
      }
    }
  }
  Check(bad == 0, "bf16x2 backprops: the two-part split's product, bitwise");
  Check(loose == 0, "bf16x2 backprops: within 2^-16 of the exact product");
}

// Packed-input backprops == float-input backprops with act_est = ste_sign,
// bitwise: both read only sign(x) and 1{|x| <= clip}.
void TestPackedBackprops(std::mt19937_64& rng, int cases) {
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  std::normal_distribution<float> normal(0.0f, 1.2f);
  for (int i = 0; i < cases; ++i) {
    ConvShape s;
    s.batch = 1 + pick(rng) % 2;
    s.in_h = 3 + pick(rng) % 9, s.in_w = 3 + pick(rng) % 9;
    const int64_t channels[] = {1, 3, 16, 33, 64};
    s.in_c = channels[pick(rng) % 5];
    s.out_c = channels[pick(rng) % 5];
    s.k_h = 1 + pick(rng) % 3, s.k_w = 1 + pick(rng) % 3;
    s.stride_h = s.stride_w = 1 + (pick(rng) % 4 == 0);
    s.dil_h = 1 + (pick(rng) % 4 == 0);
    const tapehook::Padding padding =
        pick(rng) % 2 ? tapehook::Padding::kSame : tapehook::Padding::kValid;
    if (!tapehook::ComputeConvGeometry(padding, 0, 0, 0, 0, &s).empty()) {
      continue;
    }
    const double clip = i % 3 == 0 ? 0.5 : 1.0;
    std::vector<float> x(s.batch * s.in_h * s.in_w * s.in_c);
    std::vector<float> w(s.k_h * s.k_w * s.in_c * s.out_c);
    std::vector<float> dy(s.batch * s.out_h * s.out_w * s.out_c);
    for (float& t : x) t = normal(rng);
    for (float& t : w) t = normal(rng);
    for (float& t : dy) t = normal(rng);
    x[0] = 0.0f;
    std::vector<uint8_t> packed(s.batch * s.in_h * s.in_w *
                                tapehook::PackedBytes(s.in_c));
    tapehook::PackSignMask(x.data(), s.batch * s.in_h * s.in_w, s.in_c, clip,
                           packed.data(), kSerial);
    const auto scale =
        i % 2 ? tapehook::Scale::kMeanAbs : tapehook::Scale::kNone;
    std::vector<float> want(x.size()), got(x.size());
    tapehook::BinaryConv2DBackpropInput(s, x.data(), w.data(), dy.data(),
                                        Estimator::kSteSign, clip, scale,
                                        want.data(), kSerial);
    tapehook::BinaryConv2DBackpropInputPacked(s, packed.data(), w.data(),
                                              dy.data(), clip, scale,
                                              got.data(), kSerial);
    Check(std::memcmp(want.data(), got.data(), 4 * want.size()) == 0,
          "packed backprop-input == float-input one");
    std::vector<float> want_w(w.size()), got_w(w.size());
    tapehook::BinaryConv2DBackpropFilter(
        s, x.data(), w.data(), dy.data(), Estimator::kSteSign,
        Estimator::kSteSign, clip, scale, want_w.data(), kSerial);
    tapehook::BinaryConv2DBackpropFilterPacked(
        s, packed.data(), w.data(), dy.data(), Estimator::kSteSign, clip, scale,
        got_w.data(), kSerial);
    Check(std::memcmp(want_w.data(), got_w.data(), 4 * want_w.size()) == 0,
          "packed backprop-filter == float-input one");
  }
}

// A backprop-filter whose columns do not fit in L2 runs in k blocks whose
// partial sums are added afterwards (64x64x32), or over halves of the input
// channels (36x36x128, binary x): it must agree with the non-AMX kernel.
void TestBackpropFilterBlocking(std::mt19937_64& rng, int64_t hw, int64_t c) {
  ConvShape s;
  s.batch = 2, s.in_h = hw, s.in_w = hw, s.in_c = c;
  s.k_h = 3, s.k_w = 3, s.out_c = 40;
  tapehook::ComputeConvGeometry(tapehook::Padding::kSame, 0, 0, 0, 0, &s);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(2 * hw * hw * c), w(9 * c * 40), dy(2 * hw * hw * 40);
  for (float& t : x) t = normal(rng);
  for (float& t : w) t = normal(rng);
  for (float& t : dy) t = normal(rng);
  for (Estimator act : {Estimator::kSteSign, Estimator::kNone}) {
    std::vector<float> got(w.size()), want(w.size());
    tapehook::BinaryConv2DBackpropFilter(
        s, x.data(), w.data(), dy.data(), act, Estimator::kSteSign, 1.0,
        tapehook::Scale::kMeanAbs, got.data(), kSerial);
    tapehook::cpu::SetSwitchesForTest(kNoAmx);
    tapehook::BinaryConv2DBackpropFilter(
        s, x.data(), w.data(), dy.data(), act, Estimator::kSteSign, 1.0,
        tapehook::Scale::kMeanAbs, want.data(), kSerial);
    tapehook::cpu::ClearSwitchesForTest();
    double scale = 0, err = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      scale = std::max(scale, std::abs(double(want[i])));
      err = std::max(err, std::abs(double(got[i]) - want[i]));
    }
    Check(err <= 1e-5 * scale, act == Estimator::kNone
                                   ? "k-blocked backprop-filter (float x)"
                                   : "k-blocked backprop-filter (binary x)");
  }
}

// Shards [0, total) into three uneven ranges, each run on its own thread:
// unit ranges then start and end mid-window.
const tapehook::ParallelFor kThreeThreads =
    [](int64_t total, int64_t,
       const std::function<void(int64_t, int64_t)>& fn) {
      const int64_t a = total / 5, b = total * 3 / 5;
      std::thread t1(fn, a, b), t2(fn, b, total);
      fn(0, a);
      t1.join();
      t2.join();
    };

// Inputs long enough for many A windows per thread, with thread ranges that
// start and end mid-window: the forward and backprop-input must agree with
// the non-AMX kernels (same exact products, other summation order).
void TestManyWindows(std::mt19937_64& rng, int64_t k, int64_t c) {
  ConvShape s;
  s.batch = 3, s.in_h = 23, s.in_w = 29, s.in_c = c;
  s.k_h = k, s.k_w = k, s.out_c = 70;
  tapehook::ComputeConvGeometry(tapehook::Padding::kSame, 0, 0, 0, 0, &s);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(s.batch * s.in_h * s.in_w * c), w(k * k * c * 70);
  std::vector<float> dy(s.batch * s.out_h * s.out_w * 70);
  for (float& t : x) t = normal(rng);
  for (float& t : w) t = normal(rng);
  for (float& t : dy) t = normal(rng);
  auto close = [](const std::vector<float>& got,
                  const std::vector<float>& want) {
    double scale = 0, err = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      scale = std::max(scale, std::abs(double(want[i])));
      err = std::max(err, std::abs(double(got[i]) - want[i]));
    }
    return err <= 1e-5 * scale;
  };
  const auto mean_abs = tapehook::Scale::kMeanAbs;
  std::vector<float> got(dy.size()), want(dy.size());
  tapehook::BinaryConv2DForward(s, x.data(), w.data(), false, mean_abs,
                                got.data(), kThreeThreads);
  std::vector<float> got_dx(x.size()), want_dx(x.size());
  tapehook::BinaryConv2DBackpropInput(s, x.data(), w.data(), dy.data(),
                                      Estimator::kSteSign, 1.0, mean_abs,
                                      got_dx.data(), kThreeThreads);
  tapehook::cpu::SetSwitchesForTest(kNoAmx);
  tapehook::BinaryConv2DForward(s, x.data(), w.data(), false, mean_abs,
                                want.data(), kSerial);
  tapehook::BinaryConv2DBackpropInput(s, x.data(), w.data(), dy.data(),
                                      Estimator::kSteSign, 1.0, mean_abs,
                                      want_dx.data(), kSerial);
  tapehook::cpu::ClearSwitchesForTest();
  Check(close(got, want), "forward over many windows, three threads");
  Check(close(got_dx, want_dx),
        "backprop-input over many windows, three threads");
}

// A kept forward filter (PackForwardFilter once, ForwardWith per input) gives
// Forward's outputs bit for bit, for inputs of any batch and size; it does
// not fit a filter of another geometry, and ForwardWith refuses it there.
void TestKeptForwardFilter(std::mt19937_64& rng) {
  ConvShape s;
  s.batch = 2, s.in_h = 9, s.in_w = 11, s.in_c = 45;
  s.k_h = 3, s.k_w = 3, s.out_c = 37;
  tapehook::ComputeConvGeometry(tapehook::Padding::kSame, 0, 0, 0, 0, &s);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(9 * 45 * 37), alpha(37);
  for (float& t : w) t = normal(rng);
  for (float& t : alpha) t = std::abs(normal(rng));
  const auto f = tapehook::amx::PackForwardFilter(s, w.data(), alpha.data(),
                                                  kThreeThreads);
  Check(f != nullptr, "kept forward filter: packed");
  if (f == nullptr) return;
  for (int64_t batch : {2, 1, 3}) {
    ConvShape sb = s;
    sb.batch = batch, sb.in_h = 5 + batch;
    tapehook::ComputeConvGeometry(tapehook::Padding::kSame, 0, 0, 0, 0, &sb);
    std::vector<float> x(batch * sb.in_h * sb.in_w * 45);
    for (float& t : x) t = normal(rng);
    const size_t n = batch * sb.out_h * sb.out_w * 37;
    std::vector<float> kept(n, 7.0f), fresh(n, -7.0f);
    Check(tapehook::amx::ForwardWith(sb, x.data(), *f, kept.data(),
                                     kThreeThreads),
          "kept forward filter: ran");
    tapehook::amx::Forward(sb, x.data(), w.data(), alpha.data(), fresh.data(),
                           kSerial);
    Check(std::memcmp(kept.data(), fresh.data(), n * sizeof(float)) == 0,
          "kept forward filter: same bits as Forward");
  }
  ConvShape other = s;
  other.in_c = 44;
  tapehook::ComputeConvGeometry(tapehook::Padding::kSame, 0, 0, 0, 0, &other);
  std::vector<float> x(2 * 9 * 11 * 44, 1.0f), y(2 * 9 * 11 * 37);
  Check(!tapehook::amx::ForwardFilterFits(*f, other) &&
            !tapehook::amx::ForwardWith(other, x.data(), *f, y.data(), kSerial),
        "kept forward filter: refused for another geometry");
}

// The scratch pool hands a block out again at its own size, not at the size
// of the request it last served, and spends no block on a request of less
// than half its size.
void TestScratchPool() {
  tapehook::amx::ScratchPool pool;
  const size_t big = size_t{8} << 20, small = size_t{64} << 10;
  void* b = pool.Take(big);
  pool.Give(b);
  void* half = pool.Take(big / 2 + 4096);
  Check(half == b, "pool: a request of over half a free block's size");
  pool.Give(half);
  void* again = pool.Take(big);
  Check(again == b, "pool: a block lost its size to a smaller request");
  pool.Give(again);
  void* s = pool.Take(small);
  Check(s != b, "pool: a block spent on a request under half its size");
  pool.Give(s);
}

}  // namespace

int main() {
  std::mt19937_64 rng(20261130);
  const bool amx = tapehook::amx::Usable();
  TestScratchPool();
  TestPackedBackprops(rng, 60);
  if (amx) {  // once more on the non-AMX kernels
    tapehook::cpu::SetSwitchesForTest(kNoAmx);
    TestPackedBackprops(rng, 60);
    tapehook::cpu::ClearSwitchesForTest();
  }
  std::printf("packed: %d failures\n", g_failures);
  if (!amx) {
    std::printf("amx: skipped (no AMX on this CPU or TAPEHOOK_NO_AMX set)\n");
    return g_failures == 0 ? 0 : 1;
  }
  TestBackpropFilterBlocking(rng, 64, 32);
  TestBackpropFilterBlocking(rng, 36, 128);
  TestManyWindows(rng, 1, 256);
  TestManyWindows(rng, 3, 96);
  TestKeptForwardFilter(rng);
  for (int round = 0; round < 20; ++round) {
    TestForwardSingleProduct(rng);
    TestBackpropInputSingleProduct(rng);
    TestBackpropFilterSinglePixel(rng);
    TestTwoPartDy(rng);
  }
  std::printf("amx: %d failures\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
