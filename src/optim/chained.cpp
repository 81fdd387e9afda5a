#include "hp/optim/chained.h"

#include <algorithm>

#include "hp/core/error.h"
#include "hp/optim/adamw.h"

namespace hp {

ChainedOptimizer::ChainedOptimizer(std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers)
    : optimizers_(std::move(optimizers)) {
  for (const auto& o : optimizers_) HP_CHECK(o != nullptr, "ChainedOptimizer: got an empty optimizer");
}

void ChainedOptimizer::step() {
  for (const auto& o : optimizers_) o->step();
}

void ChainedOptimizer::zero_grad() {
  for (const auto& o : optimizers_) o->zero_grad();
}

ChainedOptimizer get_hyper_optimizer(nn::Module& model, const std::vector<std::string>& muon_params,
                                     const std::vector<std::string>& adamw_params, MuonOptions muon_options,
                                     torch::optim::AdamWOptions adamw_options) {
  auto matches_any = [](const std::vector<std::string>& patterns, const std::string& fqn) {
    return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& p) { return nn::fqn_matches(p, fqn); });
  };
  std::vector<at::Tensor> muon, adamw;
  for (const auto& item : model.named_parameters()) {
    const bool to_muon = matches_any(muon_params, item.key()), to_adamw = matches_any(adamw_params, item.key());
    HP_CHECK(to_muon != to_adamw, "get_hyper_optimizer: parameter ", item.key(), " matches ",
             to_muon ? "both the Muon and the AdamW patterns" : "neither the Muon nor the AdamW patterns",
             "; every parameter needs exactly one optimizer");
    (to_muon ? muon : adamw).push_back(item.value());
  }
  std::vector<std::shared_ptr<torch::optim::Optimizer>> chain;
  if (!muon.empty()) chain.push_back(std::make_shared<Muon>(muon, muon_options));
  if (!adamw.empty()) chain.push_back(std::make_shared<AdamW>(adamw, adamw_options));
  return ChainedOptimizer(std::move(chain));
}

}  // namespace hp
