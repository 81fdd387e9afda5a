#include "hp/dcp/state_dict.h"

#include <torch/nn/module.h>

#include <unordered_map>

#include "hp/core/error.h"
#include "hp/optim/optimizer_kind.h"

namespace hp::dcp {
namespace {

// Calls fn(parameter FQN, its state) for every parameter of the optimizer (hp::visit_state); a
// parameter the model lacks is an error (its state could not be named).
template <typename Fn>
void visit_named_state(torch::optim::Optimizer& optimizer, const torch::nn::Module& model, const Fn& fn) {
  std::unordered_map<const void*, std::string> names;  // the key optimizers use for their state
  for (const auto& item : model.named_parameters()) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  visit_state(optimizer, [&](const at::Tensor& p, ParamStateFields& fields) {
    const auto it = names.find(p.unsafeGetTensorImpl());
    HP_CHECK(it != names.end(), "dcp: the optimizer holds a parameter of shape ", p.sizes(),
             " that is not a parameter of the model");
    fn(it->second, fields);
  });
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
  visit_named_state(optimizer, model, [&](const std::string& fqn, ParamStateFields& fields) {
    for (const auto& [field, tensor] : fields.tensors) state.tensors[prefix + fqn + "." + field] = tensor;
    if (fields.step) steps[fqn] = *fields.step;
  });
  state.values[prefix + "step"] = steps;
}

void restore_optimizer_values(const StateDict& state, torch::optim::Optimizer& optimizer,
                              const torch::nn::Module& model, const std::string& prefix) {
  const nlohmann::json steps = state.values.value(prefix + "step", nlohmann::json::object());
  visit_named_state(optimizer, model, [&](const std::string& fqn, ParamStateFields& fields) {
    if (!fields.step) return;
    HP_CHECK(steps.contains(fqn), "dcp: the checkpoint has no optimizer step for '", fqn, "'");
    fields.step = steps.at(fqn).get<int64_t>();
  });
}

}  // namespace hp::dcp
