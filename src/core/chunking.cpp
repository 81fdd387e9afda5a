#include "hp/core/chunking.h"

#include <algorithm>

#include "hp/core/error.h"

namespace hp {

std::vector<int64_t> chunk_sizes(int64_t length, int64_t parts) {
  HP_CHECK(parts > 0, "chunk_sizes: parts must be positive, got ", parts);
  HP_CHECK(length >= 0, "chunk_sizes: length must be non-negative, got ", length);
  const int64_t piece = (length + parts - 1) / parts;
  std::vector<int64_t> sizes(parts);
  for (int64_t i = 0; i < parts; ++i) sizes[i] = std::clamp<int64_t>(length - i * piece, 0, piece);
  return sizes;
}

int64_t chunk_offset(int64_t length, int64_t parts, int64_t index) {
  HP_CHECK(index >= 0 && index < parts, "chunk_offset: index ", index, " not in [0, ", parts, ")");
  const int64_t piece = (length + parts - 1) / parts;
  return std::min(length, index * piece);
}

}  // namespace hp
