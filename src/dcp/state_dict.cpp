#include "hp/dcp/state_dict.h"

#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <unordered_map>

#include "hp/core/error.h"
#include "hp/optim/chained.h"
#include "hp/optim/muon.h"

namespace hp::dcp {
namespace {

// Parameter FQN by TensorImpl, the key optimizers use for their state.
std::unordered_map<const void*, std::string> parameter_names(const torch::nn::Module& model) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& item : model.named_parameters()) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  return names;
}

std::string state_key(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

// Adam and AdamW keep the same fields under different types; one template serves both.
template <typename ParamState>
void add_adam_state(StateDict& out, torch::optim::Optimizer& optimizer, const at::Tensor& p, bool amsgrad,
                    const std::string& name) {
  auto& slot = optimizer.state()[state_key(p)];
  if (!slot) {  // exactly what Adam(W)::step creates on its first step
    auto s = std::make_unique<ParamState>();
    s->step(0);
    s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (amsgrad) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    slot = std::move(s);
  }
  auto& s = static_cast<ParamState&>(*slot);
  out.tensors[name + ".exp_avg"] = s.exp_avg();
  out.tensors[name + ".exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out.tensors[name + ".max_exp_avg_sq"] = s.max_exp_avg_sq();
}

// Calls fn(parameter, its FQN) for every parameter of the optimizer; a parameter the model lacks is
// an error (its state could not be named).
template <typename Fn>
void for_each_param(torch::optim::Optimizer& optimizer, const torch::nn::Module& model, const Fn& fn) {
  const auto names = parameter_names(model);
  for (auto& group : optimizer.param_groups())
    for (const at::Tensor& p : group.params()) {
      const auto it = names.find(p.unsafeGetTensorImpl());
      HP_CHECK(it != names.end(), "dcp: the optimizer holds a parameter of shape ", p.sizes(),
               " that is not a parameter of the model");
      fn(group, p, it->second);
    }
}

}  // namespace

StateDict model_state_dict(const torch::nn::Module& model, const std::string& prefix) {
  StateDict state;
  for (const auto& item : model.named_parameters()) state.tensors[prefix + item.key()] = item.value();
  for (const auto& item : model.named_buffers()) state.tensors[prefix + item.key()] = item.value();
  return state;
}

void add_optimizer_state(StateDict& state, torch::optim::Optimizer& optimizer, const torch::nn::Module& model,
                         const std::string& prefix) {
  nlohmann::json steps = state.values.value(prefix + "step", nlohmann::json::object());
  for_each_param(optimizer, model, [&](torch::optim::OptimizerParamGroup& group, const at::Tensor& p,
                                       const std::string& fqn) {
    const std::string name = prefix + fqn;
    if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&group.options())) {
      add_adam_state<torch::optim::AdamWParamState>(state, optimizer, p, o->amsgrad(), name);
      steps[fqn] = static_cast<torch::optim::AdamWParamState&>(*optimizer.state()[state_key(p)]).step();
    } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&group.options())) {
      add_adam_state<torch::optim::AdamParamState>(state, optimizer, p, o->amsgrad(), name);
      steps[fqn] = static_cast<torch::optim::AdamParamState&>(*optimizer.state()[state_key(p)]).step();
    } else if (dynamic_cast<MuonOptions*>(&group.options())) {
      auto& slot = optimizer.state()[state_key(p)];
      if (!slot) {  // Muon's first step starts from a zero momentum buffer
        auto s = std::make_unique<MuonParamState>();
        s->momentum_buffer(at::zeros_like(p));
        slot = std::move(s);
      }
      state.tensors[name + ".momentum_buffer"] = static_cast<MuonParamState&>(*slot).momentum_buffer();
    } else {
      HP_FAIL("dcp: cannot checkpoint this optimizer's state (supported: AdamW, Adam, hp::Muon)");
    }
  });
  state.values[prefix + "step"] = steps;
}

void add_optimizer_state(StateDict& state, ChainedOptimizer& optimizer, const torch::nn::Module& model,
                         const std::string& prefix) {
  for (const auto& o : optimizer.optimizers()) add_optimizer_state(state, *o, model, prefix);
}

void restore_optimizer_values(const StateDict& state, torch::optim::Optimizer& optimizer,
                              const torch::nn::Module& model, const std::string& prefix) {
  const nlohmann::json steps = state.values.value(prefix + "step", nlohmann::json::object());
  for_each_param(optimizer, model, [&](torch::optim::OptimizerParamGroup& group, const at::Tensor& p,
                                       const std::string& fqn) {
    auto& slot = optimizer.state()[state_key(p)];
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(slot.get())) {
      HP_CHECK(steps.contains(fqn), "dcp: the checkpoint has no optimizer step for '", fqn, "'");
      s->step(steps.at(fqn).get<int64_t>());
    } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(slot.get())) {
      HP_CHECK(steps.contains(fqn), "dcp: the checkpoint has no optimizer step for '", fqn, "'");
      s->step(steps.at(fqn).get<int64_t>());
    }
  });
}

void restore_optimizer_values(const StateDict& state, ChainedOptimizer& optimizer, const torch::nn::Module& model,
                              const std::string& prefix) {
  for (const auto& o : optimizer.optimizers()) restore_optimizer_values(state, *o, model, prefix);
}

}  // namespace hp::dcp
