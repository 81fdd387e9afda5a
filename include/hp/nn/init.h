// Deferred, sharding-invariant parameter initialization.
//
//   auto model = std::make_shared<MyModel>(config);   // parameters have shapes, no storage
//   hp::parallelize_module(*model, tp_mesh, plan);     // still no storage: only placements
//   hp::nn::init_parameters(*model, /*seed=*/42);      // each rank allocates and fills its shards
//
// Parameter k (in named_parameters order) draws element i of the whole parameter from a
// counter-based generator at (seed, stream k, i) as its Init says, so every local shard equals the
// matching slice of a single-device initialization with the same seed, whatever the plan.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "hp/nn/module.h"

namespace hp::nn {

// Allocates (where needed) and fills every parameter of `model`. Not collective: no communication.
// A DTensor parameter's shard is allocated on its mesh's device, a plain parameter on `device`.
void init_parameters(Module& model, uint64_t seed, c10::Device device = c10::kCPU);

// The same for the parameters whose FQN `wanted` accepts (a pipeline rank's stages), each with the
// values the whole-model call gives it; the others keep no storage.
void init_parameters(Module& model, uint64_t seed, const std::function<bool(const std::string& fqn)>& wanted,
                     c10::Device device = c10::kCPU);

// Bytes of parameter storage this rank holds (local shards of DTensors, whole plain tensors;
// parameters without storage count 0).
int64_t local_parameter_bytes(Module& model);

}  // namespace hp::nn
