// Distributed RNG: random values that do not depend on how a tensor is sharded.
//
// Random ops on DTensors (uniform_, normal_, bernoulli_, and through them dropout and the
// initializers) draw element i of the *global* tensor from a counter-based generator (Philox-4x32-10)
// keyed by the mesh's seed, with the counter (global linear index i, stream). Each op takes the next
// stream of the mesh's RNG state. So a sharded DTensor gets exactly its shard of the values the same
// op gives the whole tensor, and replicated DTensors get identical values on every rank.
//
// The state lives on the DeviceMesh (shared with its sub-meshes), never in a process global. Every
// rank must run the same random ops in the same order, like any op on DTensors.
#pragma once

#include <cstdint>
#include <vector>

#include "hp/dtensor/dtensor.h"

namespace hp {

// Seeds the RNG of `mesh` (and of every mesh sliced from the same root) and resets its stream.
void manual_seed(const DeviceMesh& mesh, uint64_t seed);

// Where the RNG of `mesh` (and its root's other meshes) stands: its seed and the stream the next
// random op takes. Saved with a checkpoint and set back on resume, it makes the resumed run draw
// what the uninterrupted run would have (hp-train does this).
struct MeshRngState {
  uint64_t seed = 0;
  uint64_t next_stream = 0;
};
MeshRngState get_rng_state(const DeviceMesh& mesh);
void set_rng_state(const DeviceMesh& mesh, const MeshRngState& state);

// New DTensors of random values (uniform in [0, 1) / standard normal), laid out by `placements`.
DTensor rand(const std::vector<int64_t>& shape, const DeviceMesh& mesh, Placements placements);
DTensor randn(const std::vector<int64_t>& shape, const DeviceMesh& mesh, Placements placements);

// Values by global position, for code that fills local pieces itself (parameter initialization,
// dropout masks): fills `piece` (at `offset` within a tensor of `global_shape`) with its part of
// the values that (seed, stream) gives the whole tensor. Element at global linear index i is drawn
// from Philox-4x32-10 with counter (i, stream) and key seed: uniform in [a, b), normal (mean a,
// std b), or bernoulli (1 with probability a).
enum class RandomFill { kUniform, kNormal, kBernoulli };
void philox_fill(const at::Tensor& piece, const std::vector<int64_t>& offset, const std::vector<int64_t>& global_shape,
                 uint64_t seed, uint64_t stream, RandomFill kind, double a, double b);

// Values for elements named by their global linear index, for pieces that are not boxes
// (attention's probabilities at scattered positions): out[n] is element global_indices[n] (int64,
// out's shape), uniform in [a, b) or bernoulli (1 with probability a). Element i is word i % 4 of
// Philox-4x32-10 at counter (i / 4, stream) under key seed, so runs of consecutive indices cost a
// quarter of philox_fill's evaluations (and the values differ from philox_fill's).
void philox_fill_at(const at::Tensor& out, const at::Tensor& global_indices, uint64_t seed, uint64_t stream,
                    RandomFill kind, double a, double b);

}  // namespace hp
