// Least squares with every coefficient at least 0, for the cost model's fits of a few terms.
#pragma once

#include <vector>

namespace hp::train::detail {

// The c >= 0 that minimises |X c - y|^2, X given by rows (all of one length, at most 16 columns):
// the best feasible unconstrained fit over the subsets of columns. Columns are scaled to their
// largest value first, and a subset whose normal equations are singular (a pivot under 1e-10 of
// the largest diagonal entry: a column that repeats others) is skipped. With `positive` (a bit per
// column), those columns are in every subset and their coefficients > 0; empty when no such fit
// exists.
std::vector<double> nonnegative_least_squares(const std::vector<std::vector<double>>& X, const std::vector<double>& y,
                                              unsigned positive = 0);

}  // namespace hp::train::detail
