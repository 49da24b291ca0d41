#include "estimator.h"

#include <cmath>

namespace tapehook {

bool ParseEstimator(const std::string& name, Estimator* out) {
  if (name == "none") {
    *out = Estimator::kNone;
  } else if (name == "ste_sign") {
    *out = Estimator::kSteSign;
  } else if (name == "approx_sign") {
    *out = Estimator::kApproxSign;
  } else if (name == "swish_sign") {
    *out = Estimator::kSwishSign;
  } else {
    return false;
  }
  return true;
}

bool ParseScale(const std::string& name, Scale* out) {
  if (name == "none") {
    *out = Scale::kNone;
  } else if (name == "mean_abs") {
    *out = Scale::kMeanAbs;
  } else {
    return false;
  }
  return true;
}

double EstimatorGrad(Estimator e, double t, double clip) {
  switch (e) {
    case Estimator::kNone:
      return 1.0;
    case Estimator::kSteSign:
      return std::abs(t) <= clip ? 1.0 : 0.0;
    case Estimator::kApproxSign:
      return std::abs(t) <= 1.0 ? 2.0 - 2.0 * std::abs(t) : 0.0;
    case Estimator::kSwishSign: {
      constexpr double kBeta = 5.0;
      const double bt = kBeta * t;
      const double ch = std::cosh(bt);
      // The true value underflows long before cosh overflows; inf / inf
      // would otherwise give NaN.
      if (!std::isfinite(ch)) return 0.0;
      return kBeta * (2.0 - bt * std::tanh(bt / 2.0)) / (1.0 + ch);
    }
  }
  return 1.0;
}

}  // namespace tapehook
