// Several optimizers stepping disjoint parameter sets as one torch::optim::Optimizer: typically Muon
// for hidden matrices and AdamW for embeddings, norms, biases and the head. Each parameter group
// steps by the optimizer its options name (MuonOptions: Muon, AdamWOptions: AdamW, or any kind
// registered with hp::register_optimizer_kind), and the chain owns every group and all state, so
// schedulers, checkpoints and zero_grad treat it as any other optimizer.
//
//   auto optimizer = hp::get_hyper_optimizer(model, {"layers.*.*.*.weight"}, {"*.weight", "*.*.*.weight"},
//                                            hp::MuonOptions(0.02), torch::optim::AdamWOptions(1e-3));
#pragma once

#include <torch/optim/adamw.h>

#include <string>
#include <utility>
#include <vector>

#include "hp/nn/module.h"
#include "hp/optim/muon.h"

namespace hp {

class ChainedOptimizer : public torch::optim::Optimizer {
 public:
  // Every group needs options of a kind that can step a single group; groups are stepped in order.
  explicit ChainedOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups);
  at::Tensor step(LossClosure closure = nullptr) override;
};

// Muon for the parameters whose FQN matches one of `muon_params`, AdamW for those matching one of
// `adamw_params` ('*' = one segment): group 0 is Muon's, group 1 AdamW's (a side with no parameter
// has no group). Every parameter must match exactly one side: a parameter matching neither or both
// is an error naming it.
ChainedOptimizer get_hyper_optimizer(nn::Module& model, const std::vector<std::string>& muon_params,
                                     const std::vector<std::string>& adamw_params, MuonOptions muon_options,
                                     torch::optim::AdamWOptions adamw_options);
// The same over given parameters by FQN (e.g. a pipeline rank's stages, which hold part of a model).
ChainedOptimizer get_hyper_optimizer(const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                                     const std::vector<std::string>& muon_params,
                                     const std::vector<std::string>& adamw_params, MuonOptions muon_options,
                                     torch::optim::AdamWOptions adamw_options);

}  // namespace hp
