// Muon: momentum, then Newton-Schulz orthogonalization of each 2-D update (quintic iteration,
// coefficients 3.4445, -4.7750, 2.0315, 5 steps, scaled by sqrt(max(1, rows / cols))), as in the
// public reference (Keller Jordan's Muon). For hidden matrices only; pair it with AdamW for
// embeddings, norms and the head.
//
// Distributed: for a DTensor parameter sharded on a 1-D mesh, each matrix's whole update is
// gathered to one owner rank of that mesh (owners balanced by matrix size, largest first, so every
// rank orthogonalizes about the same amount), orthogonalized there and scattered back; one
// all_to_all each way for all matrices of the mesh. Other layouts gather the whole update on
// every rank.
#pragma once

#include <torch/optim/optimizer.h>

#include <vector>

namespace hp {

struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  MuonOptions(double lr = 0.02) : lr_(lr) {}  // NOLINT: implicit like torch's options
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  TORCH_ARG(int64_t, ns_steps) = 5;
  TORCH_ARG(double, weight_decay) = 0.0;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct MuonParamState : public torch::optim::OptimizerCloneableParamState<MuonParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);
};

// The orthogonalized (zeroth-power) form of a 2-D matrix by the quintic Newton-Schulz iteration.
at::Tensor newton_schulz5(const at::Tensor& g, int64_t steps = 5);

class Muon : public torch::optim::Optimizer {
 public:
  explicit Muon(std::vector<at::Tensor> params, MuonOptions defaults = {});
  at::Tensor step(LossClosure closure = nullptr) override;
};

}  // namespace hp
