// ExactSquareSum adds squares without rounding: the total is the same bits for any order and any
// split of the values into parts, and it keeps what a floating-point sum loses.
#include "hp/core/exact_square_sum.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>

#include "test_util.h"

namespace hp::test {
namespace {

double exact(const at::Tensor& values) {
  ExactSquareSum sum;
  sum.add(values);
  return sum.value();
}

// The total of `parts` combined as ranks combine them: their digits summed.
double exact_in_parts(const std::vector<at::Tensor>& parts) {
  at::Tensor digits;
  for (const at::Tensor& part : parts) {
    ExactSquareSum sum;
    sum.add(part);
    digits = digits.defined() ? digits + sum.digits() : sum.digits();
  }
  return ExactSquareSum::value_of_digits(digits);
}

// Values spread over 40 binades, so that the order of a floating-point sum matters.
at::Tensor spread(int64_t n, uint64_t seed) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({n}, gen) * at::exp2(at::randint(-20, 20, {n}, gen).to(at::kFloat));
}

TEST(ExactSquareSum, KeepsWhatAFloatingPointSumLoses) {
  // 2^60 + 4096 x 1: a double running sum that starts with 2^60 drops every 1 (its ulp there is
  // 256); the exact total 2^60 + 4096 is a double.
  at::Tensor values = at::ones({4097});
  values[0] = std::ldexp(1.0, 30);
  const double want = std::ldexp(1.0, 60) + 4096.0;
  double running = 0.0;
  for (int64_t i = 0; i < values.numel(); ++i) running += std::pow(values[i].item<double>(), 2);
  ASSERT_NE(running, want) << "the example must defeat a running double sum";
  EXPECT_EQ(exact(values), want);
  EXPECT_EQ(exact(values.flip(0)), want);
  EXPECT_EQ(exact_in_parts({values.narrow(0, 1, 2000), values.narrow(0, 0, 1), values.narrow(0, 2001, 2096)}), want);
}

TEST(ExactSquareSum, TheSameBitsForAnyOrderAndSplit) {
  const at::Tensor values = spread(100000, 7);
  const double whole = exact(values);
  EXPECT_EQ(exact(values.flip(0)), whole);
  EXPECT_EQ(exact(values.index_select(0, at::randperm(values.numel(), at::make_generator<at::CPUGeneratorImpl>(3)))),
            whole);
  for (int parts : {2, 3, 4, 7}) EXPECT_EQ(exact_in_parts(values.chunk(parts)), whole) << parts << " parts";
  EXPECT_EQ(exact(values.view({400, 250}).t()), whole) << "strided";  // made contiguous inside
  const double reference = values.to(at::kDouble).pow(2).sum().item<double>();
  EXPECT_NEAR(whole, reference, 1e-13 * reference);
}

TEST(ExactSquareSum, EveryFloatingPointTypeAndTheExtremes) {
  const at::Tensor values = spread(5000, 11);
  const double fp32 = exact(values);
  EXPECT_EQ(exact(values.to(at::kDouble)), fp32) << "fp64 holds the same values";
  const at::Tensor bf16 = values.to(at::kBFloat16), fp16 = values.clamp(-60000, 60000).to(at::kHalf);
  EXPECT_EQ(exact(bf16), exact(bf16.to(at::kFloat)));
  EXPECT_EQ(exact(fp16), exact(fp16.to(at::kFloat)));
  // The smallest subnormal's square is the fp32 path's least significant bit; the largest finite
  // value's square is exact in a double.
  EXPECT_EQ(exact(at::full({3}, FLT_TRUE_MIN)), 3.0 * std::ldexp(1.0, -298));
  EXPECT_EQ(exact(at::full({1}, FLT_MAX)), static_cast<double>(FLT_MAX) * static_cast<double>(FLT_MAX));
  EXPECT_EQ(exact(at::full({1}, std::ldexp(1.0, -1074), at::kDouble)), 0.0) << "2^-2148 rounds to 0 in a double";
  EXPECT_EQ(exact(at::tensor({1e200, 1e200}, at::kDouble)), std::numeric_limits<double>::infinity());
  EXPECT_EQ(exact(at::zeros({5})), 0.0);
  EXPECT_EQ(exact(at::empty({0})), 0.0);
}

TEST(ExactSquareSum, InfinitiesAndNaNsCarryThroughTheDigits) {
  at::Tensor values = at::ones({8});
  values[3] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(exact(values)));
  EXPECT_TRUE(std::isinf(exact_in_parts({at::ones({4}), values})));
  values[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(exact_in_parts({values, at::ones({4})})));
  expect_error([] { exact(at::ones({2}, at::kInt)); }, "must be fp32, fp64, bf16 or fp16");
  expect_error([] { ExactSquareSum::value_of_digits(at::zeros({3}, at::kLong)); }, "int64 digits");
}

}  // namespace
}  // namespace hp::test
