// State dicts of models and optimizers for hp::dcp: the live tensors themselves (so load() writes
// straight into the model and the optimizer, each at its own layout) under stable names.
//
//   auto state = hp::dcp::model_state_dict(model);                  // "model.layers.0.attn.q_proj.weight", ...
//   hp::dcp::add_optimizer_state(state, optimizer, model);           // "optim.layers.0.attn.q_proj.weight.exp_avg", ...
//   state.values["step"] = step;
//   hp::dcp::save(state, dir, world);
//   ...
//   hp::dcp::load(state, dir);                                       // fresh model + optimizer, any layout
//   hp::dcp::restore_optimizer_values(state, optimizer, model);      // per-parameter step counts
#pragma once

#include <string>

#include "hp/dcp/checkpoint.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace hp {
class ChainedOptimizer;
}

namespace hp::dcp {

// Parameters and buffers by `prefix` + FQN.
StateDict model_state_dict(const torch::nn::Module& model, const std::string& prefix = "model.");

// The optimizer's per-parameter tensors as `prefix` + parameter FQN + "." + field, and its step counts
// in values[prefix + "step"]. State a first step would create is created now (zeros, step 0, exactly
// what that step would start from), so a fresh optimizer can be loaded into. Supports AdamW, Adam and
// hp::Muon (and chains of them); other optimizers are an error naming them.
void add_optimizer_state(StateDict& state, torch::optim::Optimizer& optimizer, const torch::nn::Module& model,
                         const std::string& prefix = "optim.");
void add_optimizer_state(StateDict& state, ChainedOptimizer& optimizer, const torch::nn::Module& model,
                         const std::string& prefix = "optim.");

// After load(): sets the step counts saved in `state.values`.
void restore_optimizer_values(const StateDict& state, torch::optim::Optimizer& optimizer,
                              const torch::nn::Module& model, const std::string& prefix = "optim.");
void restore_optimizer_values(const StateDict& state, ChainedOptimizer& optimizer, const torch::nn::Module& model,
                              const std::string& prefix = "optim.");

}  // namespace hp::dcp
