// State dicts of models and optimizers for hp::dcp: the live tensors themselves (so load() writes
// straight into the model and the optimizer, each at its own layout) under stable names.
//
//   auto state = hp::dcp::model_state_dict(model);              // "model.layers.0.attn.q_proj.weight", ...
//   hp::dcp::add_optimizer_state(state, optimizer, model);       // "optim.layers.0.attn.q_proj.weight.exp_avg", ...
//   state.values["step"] = step;
//   hp::dcp::save(state, dir, world);
//   ...
//   hp::dcp::load(state, dir);                                   // fresh model + optimizer, any layout
//   hp::dcp::restore_optimizer_values(state, optimizer, model);  // per-parameter step counts
#pragma once

#include <string>

#include "hp/dcp/checkpoint.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace hp::dcp {

// Parameters and buffers by `prefix` + FQN.
StateDict model_state_dict(const torch::nn::Module& model, const std::string& prefix = "model.");

// The optimizer's per-parameter tensors as `prefix` + parameter FQN + "." + field, and its step counts
// in values[prefix + "step"]. State a first step would create is created now (zeros, step 0, exactly
// what that step would start from), so a fresh optimizer can be loaded into. Fields are named by the
// optimizer's kind (hp/optim/optimizer_kind.h: AdamW, Adam, hp::Muon, a ChainedOptimizer of them, or
// any registered kind); an optimizer of no registered kind is an error naming its options type.
void add_optimizer_state(StateDict& state, torch::optim::Optimizer& optimizer, const torch::nn::Module& model,
                         const std::string& prefix = "optim.");

// After load(): sets the step counts saved in `state.values`.
void restore_optimizer_values(const StateDict& state, torch::optim::Optimizer& optimizer,
                              const torch::nn::Module& model, const std::string& prefix = "optim.");

}  // namespace hp::dcp
