// One interface to every optimizer hp knows, keyed by the type of a parameter group's options: how
// to step one group and how to name each parameter's state. Checkpoints (hp::dcp) and
// ChainedOptimizer use only this, so a new optimizer needs one register_optimizer_kind call and no
// change anywhere else.
//
//   hp::visit_state(optimizer, [&](const at::Tensor& param, hp::ParamStateFields& fields) {
//     for (auto& [field, tensor] : fields.tensors) ...;   // "exp_avg", "exp_avg_sq" / "momentum_buffer"
//   });
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <typeindex>
#include <utility>
#include <vector>

namespace hp {

// An optimizer's per-parameter state, keyed as torch::optim keys it (the parameter's TensorImpl).
using OptimizerStateMap = std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

// The state key of parameter `p` in an OptimizerStateMap.
// LibTorch 1.13 keys the map by the printed address of the parameter's TensorImpl, 2.x by the address.
OptimizerStateMap::key_type optimizer_state_key(const at::Tensor& p);

// One parameter's state: its live tensors by field name (loading a checkpoint writes into them in
// place) and its step count where the optimizer keeps one per parameter.
struct ParamStateFields {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::optional<int64_t> step;
};

class OptimizerKind {
 public:
  virtual ~OptimizerKind() = default;
  virtual std::string name() const = 0;
  // Fills an empty `slot` with the state the first step would create for `p` (zeros, step 0).
  virtual void init_state(const torch::optim::OptimizerOptions& options, const at::Tensor& p,
                          std::unique_ptr<torch::optim::OptimizerParamState>& slot) const = 0;
  virtual ParamStateFields fields(torch::optim::OptimizerParamState& state) const = 0;
  // Sets the step count of a state that keeps one (fields() gave it a value).
  virtual void set_step(torch::optim::OptimizerParamState& /*state*/, int64_t /*step*/) const {}
  // Refuses a group this optimizer cannot step (e.g. Muon given a vector), naming the problem.
  virtual void validate(const torch::optim::OptimizerParamGroup& /*group*/) const {}
  // Whether step_group exists: only such kinds can be part of a ChainedOptimizer.
  virtual bool can_step_group() const { return false; }
  // One step of one group whose gradients are set, over the optimizer's state map. Collective
  // where the optimizer is (Muon with sharded parameters).
  virtual void step_group(torch::optim::OptimizerParamGroup& group, OptimizerStateMap& state) const;
};

// Makes `kind` the optimizer of groups whose options are of type `options_type`. Built in:
// torch::optim::AdamWOptions (hp::AdamW's foreach step), torch::optim::AdamOptions (state only:
// checkpointable, not chainable) and hp::MuonOptions.
void register_optimizer_kind(std::type_index options_type, std::shared_ptr<const OptimizerKind> kind);

// The kind of a group's options; an error naming the options type when none is registered.
const OptimizerKind& optimizer_kind(const torch::optim::OptimizerOptions& options);

// Calls fn(parameter, its state) for every parameter of every group, in order, first creating the
// state a first step would create where there is none yet (so a fresh optimizer can be loaded into).
// A step count that fn changes is written back.
void visit_state(torch::optim::Optimizer& optimizer,
                 const std::function<void(const at::Tensor& param, ParamStateFields& fields)>& fn);

}  // namespace hp
