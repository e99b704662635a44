//===- FiniteDifferences.h - Gradient checks for the kernel tests -*- C++ -*-===//
//
// Random inputs, and the worst error of an analytic gradient of
// L(x) = r . f(x) against central finite differences, in double.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_UNITTESTS_FINITEDIFFERENCES_H
#define TESSEL_UNITTESTS_FINITEDIFFERENCES_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <vector>

namespace tessel::testing {

using Vec = std::vector<double>;
using Fn = std::function<Vec(const Vec &)>;

inline Vec randVec(size_t n, std::mt19937 &gen, double lo = -1,
                   double hi = 1) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Vec v(n);
  for (double &x : v)
    x = dist(gen);
  return v;
}

inline double dot(const Vec &a, const Vec &b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i)
    s += a[i] * b[i];
  return s;
}

// Largest |analytic - numeric| / max(1, |numeric|) over all inputs, with
// step h.
inline double gradError(const Fn &f, Vec x, const Vec &r, const Vec &analytic,
                        double h = 1e-6) {
  EXPECT_EQ(analytic.size(), x.size());
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = dot(r, f(x));
    x[i] = x0 - h;
    const double lm = dot(r, f(x));
    x[i] = x0;
    const double numeric = (lp - lm) / (2 * h);
    worst = std::max(worst, std::fabs(analytic[i] - numeric) /
                                std::max(1.0, std::fabs(numeric)));
  }
  return worst;
}

} // namespace tessel::testing

#endif // TESSEL_UNITTESTS_FINITEDIFFERENCES_H
