// How the fused-kernel tests compare a kernel with its ATen composition.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>

namespace hp::test {

// |got - want| <= tolerance * terms, element by element, in fp64: terms bounds the magnitude of
// what the result sums and multiplies, so a result that nearly cancels is held to the rounding of
// its terms, not of itself.
inline void expect_within_terms(const at::Tensor& got, const at::Tensor& want, const at::Tensor& terms,
                                double tolerance, const std::string& what) {
  const at::Tensor excess = (got.to(at::kDouble) - want.to(at::kDouble)).abs() - tolerance * terms.to(at::kDouble);
  EXPECT_LE(excess.max().item<double>(), 0.0) << what;
}

// The largest elementwise difference of got from truth.
inline double largest_difference(const at::Tensor& got, const at::Tensor& truth) {
  return (got.to(at::kDouble) - truth.to(at::kDouble)).abs().max().item<double>();
}

// A bf16 kernel's result no farther from the fp32 computation than the bf16 composition's, in
// their largest differences (printed).
inline void expect_no_farther_from_fp32(const std::string& name, const at::Tensor& fused, const at::Tensor& composed,
                                        const at::Tensor& fp32) {
  const double ours = largest_difference(fused, fp32), aten = largest_difference(composed, fp32);
  EXPECT_LE(ours, aten) << name;
  std::cout << "bf16 " << name << ": largest difference to fp32 " << ours << " fused, " << aten << " composed\n";
}

}  // namespace hp::test
