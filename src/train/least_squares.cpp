#include "train/least_squares.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "hp/core/error.h"

namespace hp::train::detail {
namespace {

// The unconstrained fit on columns `used` of the scaled X, or empty when it is singular.
std::vector<double> fit_on(const std::vector<std::vector<double>>& X, const std::vector<double>& y,
                           const std::vector<size_t>& used) {
  const size_t k = used.size();
  std::vector<std::vector<double>> a(k, std::vector<double>(k + 1, 0.0));  // the normal equations
  for (size_t r = 0; r < X.size(); ++r)
    for (size_t i = 0; i < k; ++i) {
      for (size_t j = 0; j < k; ++j) a[i][j] += X[r][used[i]] * X[r][used[j]];
      a[i][k] += X[r][used[i]] * y[r];
    }
  double largest = 0;
  for (size_t i = 0; i < k; ++i) largest = std::max(largest, std::abs(a[i][i]));
  for (size_t i = 0; i < k; ++i) {  // Gauss-Jordan with partial pivoting
    size_t pivot = i;
    for (size_t r = i + 1; r < k; ++r)
      if (std::abs(a[r][i]) > std::abs(a[pivot][i])) pivot = r;
    std::swap(a[i], a[pivot]);
    if (!(std::abs(a[i][i]) > 1e-10 * largest)) return {};
    for (size_t r = 0; r < k; ++r) {
      if (r == i) continue;
      const double f = a[r][i] / a[i][i];
      for (size_t j = i; j <= k; ++j) a[r][j] -= f * a[i][j];
    }
  }
  std::vector<double> c(k);
  for (size_t i = 0; i < k; ++i) c[i] = a[i][k] / a[i][i];
  return c;
}

}  // namespace

std::vector<double> nonnegative_least_squares(const std::vector<std::vector<double>>& X, const std::vector<double>& y,
                                              unsigned positive) {
  HP_CHECK(!X.empty() && X.size() == y.size() && !X.front().empty() && X.front().size() <= 16,
           "nonnegative_least_squares: needs rows of at most 16 columns, one value each");
  const size_t cols = X.front().size();
  std::vector<double> scale(cols, 0.0);
  for (const auto& row : X) {
    HP_CHECK(row.size() == cols, "nonnegative_least_squares: rows of different lengths");
    for (size_t j = 0; j < cols; ++j) scale[j] = std::max(scale[j], std::abs(row[j]));
  }
  std::vector<std::vector<double>> scaled = X;
  for (auto& row : scaled)
    for (size_t j = 0; j < cols; ++j) row[j] = scale[j] > 0 ? row[j] / scale[j] : 0.0;
  std::vector<double> best(cols, 0.0);
  double best_error = std::numeric_limits<double>::infinity();
  if (positive == 0) {  // all coefficients 0
    best_error = 0;
    for (double v : y) best_error += v * v;
  }
  for (unsigned subset = 1; subset < (1u << cols); ++subset) {
    if ((subset & positive) != positive) continue;
    std::vector<size_t> used;
    for (size_t j = 0; j < cols; ++j)
      if ((subset >> j) & 1u && scale[j] > 0) used.push_back(j);
    if (used.size() != static_cast<size_t>(__builtin_popcount(subset))) continue;  // an all-zero column
    const std::vector<double> c = fit_on(scaled, y, used);
    bool feasible = !c.empty();
    for (size_t i = 0; i < c.size() && feasible; ++i)
      feasible = std::isfinite(c[i]) && ((positive >> used[i]) & 1u ? c[i] > 0 : c[i] >= 0);
    if (!feasible) continue;
    double error = 0;
    for (size_t r = 0; r < scaled.size(); ++r) {
      double fit = 0;
      for (size_t i = 0; i < used.size(); ++i) fit += scaled[r][used[i]] * c[i];
      error += (y[r] - fit) * (y[r] - fit);
    }
    if (error < best_error) {
      best_error = error;
      std::fill(best.begin(), best.end(), 0.0);
      for (size_t i = 0; i < used.size(); ++i) best[used[i]] = c[i] / scale[used[i]];
    }
  }
  if (!std::isfinite(best_error)) return {};
  return best;
}

}  // namespace hp::train::detail
