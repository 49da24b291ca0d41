// The binary spec's enums: estimators (pseudo-derivatives of sign) and the
// filter scale, with their attr names.
#ifndef TAPEHOOK_CORE_ESTIMATOR_H_
#define TAPEHOOK_CORE_ESTIMATOR_H_

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

}  // namespace tapehook

#endif  // TAPEHOOK_CORE_ESTIMATOR_H_
