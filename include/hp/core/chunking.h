// How a length is split into pieces across ranks: torch.chunk semantics, used by every layer that
// splits tensors (reduce_scatter, the deterministic all_reduce, DTensor Shard placements).
#pragma once

#include <cstdint>
#include <vector>

namespace hp {

// Sizes of the `parts` pieces torch.chunk(x, parts) produces for a dim of `length`, padded with
// zero-size pieces up to `parts` (torch.chunk itself returns fewer pieces when it runs out):
// each piece has ceil(length / parts) elements except at the end, e.g. 5 into 4 -> {2, 2, 1, 0}.
std::vector<int64_t> chunk_sizes(int64_t length, int64_t parts);

// Offset of piece `index` under chunk_sizes(length, parts).
int64_t chunk_offset(int64_t length, int64_t parts, int64_t index);

}  // namespace hp
