// AdamW with a multi-tensor (foreach) fast path.
//
// Same update, options and state as torch::optim::AdamW (it is one: checkpoints, schedules and
// get_hyper_optimizer treat it alike), but one step runs a handful of at::_foreach_* kernels over
// all parameters of a group instead of ~10 ops per parameter, and it works on the local pieces of
// DTensor parameters directly: the update is elementwise, so each rank updates its shard and no op
// goes through DTensor dispatch. Results are bitwise those of torch::optim::AdamW.
#pragma once

#include <torch/optim/adamw.h>

#include <vector>

namespace hp {

class AdamW : public torch::optim::AdamW {
 public:
  explicit AdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {}, bool foreach = true)
      : torch::optim::AdamW(std::move(params), std::move(defaults)), foreach_(foreach) {}
  at::Tensor step(LossClosure closure = nullptr) override;

 private:
  bool foreach_;
};

}  // namespace hp
