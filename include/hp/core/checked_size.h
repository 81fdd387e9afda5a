// Sizes that come from files (safetensors headers, checkpoint metadata) multiplied without wrapping:
// a hostile header must not pass a size check because its product wrapped around.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace hp {

// start * factors[0] * factors[1] * ..., or nullopt when a factor is negative or the product
// leaves int64's range.
inline std::optional<int64_t> checked_product(const std::vector<int64_t>& factors, int64_t start = 1) {
  if (start < 0) return std::nullopt;
  int64_t product = start;
  for (int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(product, f, &product)) return std::nullopt;
  return product;
}

}  // namespace hp
