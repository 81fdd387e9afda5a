// Several optimizers stepping disjoint parameter sets as one: typically Muon for hidden matrices
// and AdamW for embeddings, norms, biases and the head.
//
//   auto optimizer = hp::get_hyper_optimizer(model, {"layers.*.*.*.weight"}, {"*.weight", "*.*.*.weight"},
//                                            hp::MuonOptions(0.02), torch::optim::AdamWOptions(1e-3));
#pragma once

#include <torch/optim/adamw.h>

#include <memory>
#include <string>
#include <vector>

#include "hp/nn/module.h"
#include "hp/optim/muon.h"

namespace hp {

class ChainedOptimizer {
 public:
  explicit ChainedOptimizer(std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers);
  void step();
  void zero_grad();
  const std::vector<std::shared_ptr<torch::optim::Optimizer>>& optimizers() const { return optimizers_; }

 private:
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers_;
};

// Muon for the parameters whose FQN matches one of `muon_params`, AdamW for those matching one of
// `adamw_params` ('*' = one segment). Every parameter must match exactly one side: a parameter
// matching neither or both is an error naming it.
ChainedOptimizer get_hyper_optimizer(nn::Module& model, const std::vector<std::string>& muon_params,
                                     const std::vector<std::string>& adamw_params, MuonOptions muon_options,
                                     torch::optim::AdamWOptions adamw_options);

}  // namespace hp
