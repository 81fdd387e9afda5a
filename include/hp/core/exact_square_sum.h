// The sum of squares of floating-point values, computed without rounding.
//
// Why: a gradient norm summed in floating point depends on the order of the additions, and so on
// how the gradients are split over ranks and threads. Deterministic training needs a norm that is
// the same bits for any data-parallel degree. Here every square (exact: an fp32 value's square has
// at most 48 significant bits, an fp64 value's 106) is added into one wide fixed-point integer
// whose least significant bit is the smallest square there is, so the total is exact. Totals of
// several ranks combine by an integer all_reduce of digits(), exact in any order. Rounding to a
// double happens once, in value(), as a fixed function of the exact total.
//
// Cost: about a nanosecond per element on one core (a scalar loop over the bits).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

namespace hp {

class ExactSquareSum {
 public:
  // Adds the square of every element of `values` (fp32, fp64, bf16 or fp16; any strides). Meta
  // tensors (a dry run) have no values: the sum becomes unknown (NaN).
  void add(const at::Tensor& values);

  // The total as int64 digits for an all_reduce (kSum) over ranks: every entry stays below 2^32
  // here, so sums over up to 2^31 ranks cannot overflow. The last two count infinities and NaNs.
  at::Tensor digits() const;

  // The total of the squares, rounded to a double (an infinity or a NaN among the values gives
  // inf or NaN); `summed` is digits() summed over ranks. The same total gives the same bits.
  double value() const;
  static double value_of_digits(const at::Tensor& summed);

  // 4352 bits from 2^-2148 (the square of the smallest fp64 subnormal) up: enough for 2^64 squares
  // of the largest finite fp64 value.
  static constexpr int kLimbs = 68;

 private:
  void add_shifted(unsigned __int128 value, int bit);
  template <typename Bits>
  void add_ieee(const Bits* bits, int64_t n);

  std::array<uint64_t, kLimbs> limbs_{};  // little-endian
  int64_t infinities_ = 0, nans_ = 0;
};

}  // namespace hp
