// A training step of a layout without the trainer around it (no data, metrics or checks): the
// cost model's calibration times the model with it, and tests record its work.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/train/config.h"
#include "hp/train/train_step.h"
#include "train/setup.h"

namespace hp::train::detail {

class WorkRecorder;

// The model on `world` as `config` lays it out (its mesh, plans and optimizer), stepping on random
// tokens: the same on every rank (tp ranks must see the same rows; the data does not change the
// time).
class LayoutStep {
 public:
  // `micro_batches` per step (0: the config's).
  LayoutStep(const TrainConfig& config, const comm::ProcessGroup& world, int64_t micro_batches = 0);
  LayoutStep(const LayoutStep&) = delete;
  LayoutStep& operator=(const LayoutStep&) = delete;

  // A step of `rows` sequences, split into its micro-batches: zero_grad, forward and backward,
  // gradient clipping, the optimizer step; from the clipping on, `recorder`'s optimizer phase.
  void run(int64_t rows, WorkRecorder* recorder = nullptr);

  const models::ModelParts& parts() const { return s_->parts; }

 private:
  TrainConfig c_;
  comm::ProcessGroup world_;
  std::unique_ptr<Setup> s_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<TrainStep> step_;
  std::vector<at::Tensor> counted_, copies_;
  int64_t step_number_ = 0;
};

}  // namespace hp::train::detail
