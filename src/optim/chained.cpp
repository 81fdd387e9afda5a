#include "hp/optim/chained.h"

#include <algorithm>
#include <set>

#include "hp/core/error.h"
#include "hp/optim/optimizer_kind.h"
#include "optim/closure.h"

namespace hp {
namespace {

// Checks the groups: each has options of a kind that can step one group and accepts the group,
// and no parameter is in two groups (it would be stepped twice).
void check_chainable(const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  HP_CHECK(!groups.empty(), "ChainedOptimizer: needs at least one parameter group");
  std::set<const void*> seen;
  for (size_t i = 0; i < groups.size(); ++i) {
    for (const at::Tensor& p : groups[i].params())
      HP_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "ChainedOptimizer: a parameter of shape ", p.sizes(),
               " is in more than one group (group ", i, " repeats it)");
    HP_CHECK(groups[i].has_options(), "ChainedOptimizer: parameter group ", i,
             " has no options; they name the optimizer that steps it");
    const OptimizerKind& kind = optimizer_kind(groups[i].options());
    HP_CHECK(kind.can_step_group(), "ChainedOptimizer: parameter group ", i, " is ", kind.name(),
             "'s, which cannot step a single group");
    kind.validate(groups[i]);
  }
}

}  // namespace

ChainedOptimizer::ChainedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups)
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{}, nullptr) {
  check_chainable(groups);
  defaults_ = groups.front().options().clone();  // add_param_group wants defaults; every group has its own
  for (const auto& group : groups) add_param_group(group);
}

at::Tensor ChainedOptimizer::step(LossClosure closure) {
  const at::Tensor loss = detail::evaluate_closure(closure);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups()) optimizer_kind(group.options()).step_group(group, state());
  return loss;
}

ChainedOptimizer get_hyper_optimizer(nn::Module& model, const std::vector<std::string>& muon_params,
                                     const std::vector<std::string>& adamw_params, MuonOptions muon_options,
                                     torch::optim::AdamWOptions adamw_options) {
  std::vector<std::pair<std::string, at::Tensor>> parameters;
  for (const auto& item : model.named_parameters()) parameters.emplace_back(item.key(), item.value());
  return get_hyper_optimizer(parameters, muon_params, adamw_params, std::move(muon_options), std::move(adamw_options));
}

ChainedOptimizer get_hyper_optimizer(const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                                     const std::vector<std::string>& muon_params,
                                     const std::vector<std::string>& adamw_params, MuonOptions muon_options,
                                     torch::optim::AdamWOptions adamw_options) {
  auto matches_any = [](const std::vector<std::string>& patterns, const std::string& fqn) {
    return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return nn::fqn_matches(p, fqn); });
  };
  std::vector<at::Tensor> muon, adamw;
  for (const auto& [fqn, p] : parameters) {
    const bool to_muon = matches_any(muon_params, fqn), to_adamw = matches_any(adamw_params, fqn);
    HP_CHECK(to_muon != to_adamw, "get_hyper_optimizer: parameter ", fqn, " matches ",
             to_muon ? "both the Muon and the AdamW patterns" : "neither the Muon nor the AdamW patterns",
             "; every parameter needs exactly one optimizer");
    (to_muon ? muon : adamw).push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!muon.empty()) groups.emplace_back(muon, std::make_unique<MuonOptions>(muon_options));
  if (!adamw.empty()) groups.emplace_back(adamw, std::make_unique<torch::optim::AdamWOptions>(adamw_options));
  return ChainedOptimizer(std::move(groups));
}

}  // namespace hp
