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
// subnormal counts as e = 1, without the implicit bit) and integer significand m is
// m * 2^(e - bias - mantissa bits), so its square starts at bit 2 (e - bias - mantissa bits) + 2148.
constexpr int kUnitExponent = -2148;

// What the sum needs of an IEEE binary format, by the unsigned integer type of its bits. A bin
// holds squares of significands (below 2^(2 (mantissa bits + 1))) until it could overflow.
template <typename Bits>
struct Format;
template <>
struct Format<uint32_t> {  // fp32
  using Bin = uint64_t;
  static constexpr int kMantissaBits = 23, kExponentBits = 8, kBias = 127;
};
template <>
struct Format<uint64_t> {  // fp64
  using Bin = unsigned __int128;
  static constexpr int kMantissaBits = 52, kExponentBits = 11, kBias = 1023;
};

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

template <typename Bits>
void ExactSquareSum::add_ieee(const Bits* bits, int64_t n) {
  using F = Format<Bits>;
  using Bin = typename F::Bin;
  constexpr int kSignificandBits = F::kMantissaBits + 1;
  constexpr int64_t kFlushEvery = int64_t{1} << (8 * sizeof(Bin) - 2 * kSignificandBits);
  constexpr Bits kExponents = Bits{1} << F::kExponentBits, kMantissaMask = (Bits{1} << F::kMantissaBits) - 1;
  constexpr Bits kMagnitudeMask = static_cast<Bits>(~Bits{0} >> 1), kImplicitBit = Bits{1} << F::kMantissaBits;
  const auto square_bit = [](Bits e) {
    return 2 * (static_cast<int>(std::max<Bits>(e, 1)) - F::kBias - F::kMantissaBits) - kUnitExponent;
  };
  std::vector<Bin> bins(kBinArrays * kExponents);
  for (int64_t start = 0; start < n; start += kFlushEvery) {
    const int64_t end = std::min(n, start + kFlushEvery);
    for (int64_t i = start; i < end; ++i) {
      const Bits b = bits[i] & kMagnitudeMask, e = b >> F::kMantissaBits, f = b & kMantissaMask;
      if (e == kExponents - 1) {  // infinity or NaN
        (f ? nans_ : infinities_) += 1;
        continue;
      }
      const Bin m = f | (e ? kImplicitBit : 0);
      bins[(i % kBinArrays) * kExponents + e] += m * m;
    }
    for (int a = 0; a < kBinArrays; ++a)
      for (Bits e = 0; e + 1 < kExponents; ++e)
        if (Bin& bin = bins[a * kExponents + e]; bin != 0) add_shifted(bin, square_bit(e)), bin = 0;
  }
}

void ExactSquareSum::add(const at::Tensor& values) {
  if (values.is_meta()) {  // a dry run's values are unknown, and so is the sum
    nans_ += values.numel() > 0;
    return;
  }
  if (!values.is_cpu()) return add(values.to(at::kCPU));  // the digits are summed on the host
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
