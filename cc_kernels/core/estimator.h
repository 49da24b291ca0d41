// The binary spec's enums: estimators (pseudo-derivatives of sign) and the
// filter scale, with their attr names.
#ifndef TAPEHOOK_CORE_ESTIMATOR_H_
#define TAPEHOOK_CORE_ESTIMATOR_H_

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

namespace tapehook {

// Pseudo-derivative of sign used in the backward pass.
enum class Estimator : int {
  kNone = 0,        // not binarized (float input); derivative 1
  kSteSign = 1,     // 1{|t| <= clip}
  kApproxSign = 2,  // (2 - 2|t|) * 1{|t| <= 1}
  kSwishSign =
      3,  // beta (2 - beta t tanh(beta t / 2)) / (1 + cosh(beta t)), beta = 5
};

enum class Scale : int { kNone = 0, kMeanAbs = 1 };

// Parses "none" / "ste_sign" / "approx_sign" / "swish_sign"; false if unknown.
bool ParseEstimator(const std::string& name, Estimator* out);
bool ParseScale(const std::string& name, Scale* out);

// e'(t) for an estimator (kNone gives 1).
double EstimatorGrad(Estimator e, double t, double clip);

// approx_sign's e'(t) in float or double, inline and branch-free so that a
// loop over a tensor vectorizes even at the baseline ISA (EstimatorGrad is a
// call per element whose branches mispredict on activations: ~4 ns an
// element; a float compare-and-select is not if-converted under
// -ftrapping-math). m = min(|t|, 1) is taken on the bit patterns, which
// order like the values for non-negative floats (NaN's patterns lie above
// 1's: m = 1, e' = 0, as EstimatorGrad gives). 2m is exact and 2 - 2m one
// rounding of the exact value, as is EstimatorGrad's double result cast to
// the type: the two agree bit for bit (tests/cc).
template <typename T, typename Bits, Bits kOne>
inline T ApproxSignGradBits(T t) {
  Bits b;
  std::memcpy(&b, &t, sizeof(T));
  b &= std::numeric_limits<Bits>::max();  // |t|: clear the sign bit
  const Bits m = b < kOne ? b : kOne;
  T mt;
  std::memcpy(&mt, &m, sizeof(T));
  return T(2) - T(2) * mt;
}
inline float ApproxSignGrad(float t) {
  return ApproxSignGradBits<float, int32_t, 0x3f800000>(t);
}
inline double ApproxSignGrad(double t) {
  return ApproxSignGradBits<double, int64_t, 0x3ff0000000000000>(t);
}

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_ESTIMATOR_H_
