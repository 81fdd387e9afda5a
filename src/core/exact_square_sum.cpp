#include "hp/core/exact_square_sum.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "hp/core/error.h"

namespace hp {
namespace {

// The fixed-point integer counts units of 2^-2148. An IEEE value with biased exponent e (a
// subnormal counts as e = 1, without the implicit bit) and integer significand m is m * 2^(e - B),
// so its square m^2 * 2^(2e - 2B) starts at bit 2e - 2B + 2148.
constexpr int kUnitExponent = -2148;
int float_square_bit(uint32_t e) { return 2 * static_cast<int>(std::max(e, 1u)) - 300 - kUnitExponent; }
int double_square_bit(uint64_t e) { return 2 * static_cast<int>(std::max<uint64_t>(e, 1)) - 2150 - kUnitExponent; }

// Squares go into per-exponent bins; several bin arrays, used in turn, keep consecutive elements
// with the same exponent from waiting on each other's store.
constexpr int kBinArrays = 4;

}  // namespace

void ExactSquareSum::add_shifted(unsigned __int128 value, int bit) {
  const int limb = bit / 64, shift = bit % 64;
  const auto low = static_cast<uint64_t>(value), high = static_cast<uint64_t>(value >> 64);
  const uint64_t parts[3] = {low << shift, shift ? (high << shift) | (low >> (64 - shift)) : high,
                             shift ? high >> (64 - shift) : 0};
  for (int p = 0; p < 3; ++p) {
    uint64_t carry = parts[p];
    for (int i = limb + p; carry != 0; ++i) {
      HP_CHECK(i < kLimbs, "ExactSquareSum: the total overflowed ", 64 * kLimbs, " bits");
      limbs_[i] += carry;
      carry = limbs_[i] < carry ? 1 : 0;
    }
  }
}

template <>
void ExactSquareSum::add_ieee(const uint32_t* bits, int64_t n) {
  // A fp32 significand is below 2^24, its square below 2^48: a uint64 bin takes 2^16 of them.
  constexpr int64_t kFlushEvery = int64_t{1} << 16;
  uint64_t bins[kBinArrays][256] = {};
  for (int64_t start = 0; start < n; start += kFlushEvery) {
    const int64_t end = std::min(n, start + kFlushEvery);
    for (int64_t i = start; i < end; ++i) {
      const uint32_t b = bits[i] & 0x7fffffffu, e = b >> 23, f = b & 0x7fffffu;
      if (e == 255) {
        (f ? nans_ : infinities_) += 1;
        continue;
      }
      const uint64_t m = f | (e ? 0x800000u : 0u);
      bins[i % kBinArrays][e] += m * m;
    }
    for (auto& array : bins)
      for (uint32_t e = 0; e < 255; ++e)
        if (array[e]) add_shifted(array[e], float_square_bit(e)), array[e] = 0;
  }
}

template <>
void ExactSquareSum::add_ieee(const uint64_t* bits, int64_t n) {
  // A fp64 significand is below 2^53, its square below 2^106: a 128-bit bin takes 2^21 of them.
  constexpr int64_t kFlushEvery = int64_t{1} << 21;
  std::vector<unsigned __int128> bins(kBinArrays * 2048);
  for (int64_t start = 0; start < n; start += kFlushEvery) {
    const int64_t end = std::min(n, start + kFlushEvery);
    for (int64_t i = start; i < end; ++i) {
      const uint64_t b = bits[i] & 0x7fffffffffffffffull, e = b >> 52, f = b & 0xfffffffffffffull;
      if (e == 2047) {
        (f ? nans_ : infinities_) += 1;
        continue;
      }
      const unsigned __int128 m = f | (e ? 0x10000000000000ull : 0ull);
      bins[(i % kBinArrays) * 2048 + e] += m * m;
    }
    for (int a = 0; a < kBinArrays; ++a)
      for (uint64_t e = 0; e < 2047; ++e)
        if (unsigned __int128& bin = bins[a * 2048 + e]; bin != 0) add_shifted(bin, double_square_bit(e)), bin = 0;
  }
}

void ExactSquareSum::add(const at::Tensor& values) {
  const at::ScalarType type = values.scalar_type();
  if (type == at::kFloat || type == at::kDouble) {
    const at::Tensor t = values.contiguous();
    if (type == at::kFloat)
      add_ieee(static_cast<const uint32_t*>(t.data_ptr()), t.numel());
    else
      add_ieee(static_cast<const uint64_t*>(t.data_ptr()), t.numel());
    return;
  }
  HP_CHECK(type == at::kBFloat16 || type == at::kHalf, "ExactSquareSum: values must be fp32, fp64, bf16 or fp16, got ",
           type);
  // Widened to fp32 (exact) a slice at a time, so no full-size copy exists.
  const at::Tensor flat = values.reshape({-1});
  constexpr int64_t kSlice = int64_t{1} << 16;
  for (int64_t start = 0; start < flat.numel(); start += kSlice) {
    const at::Tensor wide = flat.narrow(0, start, std::min(kSlice, flat.numel() - start)).to(at::kFloat).contiguous();
    add_ieee(static_cast<const uint32_t*>(wide.data_ptr()), wide.numel());
  }
}

at::Tensor ExactSquareSum::digits() const {
  at::Tensor out = at::empty({2 * kLimbs + 2}, at::kLong);
  int64_t* d = out.data_ptr<int64_t>();
  for (int i = 0; i < kLimbs; ++i) {
    d[2 * i] = static_cast<int64_t>(limbs_[i] & 0xffffffffu);
    d[2 * i + 1] = static_cast<int64_t>(limbs_[i] >> 32);
  }
  d[2 * kLimbs] = infinities_;
  d[2 * kLimbs + 1] = nans_;
  return out;
}

double ExactSquareSum::value_of_digits(const at::Tensor& summed) {
  HP_CHECK(summed.scalar_type() == at::kLong && summed.dim() == 1 && summed.numel() == 2 * kLimbs + 2,
           "ExactSquareSum: expected ", 2 * kLimbs + 2, " int64 digits, got ", summed.sizes(), " ",
           summed.scalar_type());
  const at::Tensor t = summed.contiguous();
  const int64_t* d = t.data_ptr<int64_t>();
  ExactSquareSum total;
  for (int i = 0; i < 2 * kLimbs; ++i) {
    HP_CHECK(d[i] >= 0, "ExactSquareSum: digit ", i, " is negative (", d[i], "): not a sum of digits()");
    total.add_shifted(static_cast<uint64_t>(d[i]), 32 * i);
  }
  total.infinities_ = d[2 * kLimbs];
  total.nans_ = d[2 * kLimbs + 1];
  return total.value();
}

double ExactSquareSum::value() const {
  if (nans_) return std::numeric_limits<double>::quiet_NaN();
  if (infinities_) return std::numeric_limits<double>::infinity();
  int top = kLimbs - 1;
  while (top >= 0 && limbs_[top] == 0) --top;
  if (top < 0) return 0.0;
  // The 64 bits from the highest set one down, converted with the hardware's rounding, then
  // scaled: a fixed function of the total (within 2^-52 of it, relative).
  const int lead = __builtin_clzll(limbs_[top]);
  const uint64_t below = top > 0 ? limbs_[top - 1] : 0;
  const uint64_t head = (limbs_[top] << lead) | (lead ? below >> (64 - lead) : 0);
  return std::ldexp(static_cast<double>(head), 64 * top - lead + kUnitExponent);
}

}  // namespace hp
