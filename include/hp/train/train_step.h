// One training step's forward and backward over a rank's rows of the batch, whatever the model's
// parallel layout: the one place in the trainer that knows whether the model runs whole on this
// rank (gradient accumulation over micro-batches) or as pipeline stages (the schedule splits the
// rows into its micro-batches). The loop, evaluation and generation go through it.
//
// Collective: with a pipeline, every rank of the pipeline calls each method in the same order.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "hp/models/model_parts.h"

namespace hp::train {

struct TrainStepOptions {
  int64_t micro_batches = 1;  // micro-batches per step on a rank without a pipeline
  // Without a pipeline: sum each gradient over the micro-batches in tree_reduce's order (FSDP
  // units reduce once, after the last micro-batch), so that with a deterministic world group the
  // result does not depend on how the micro-batches are spread over data-parallel ranks. Off: FSDP
  // reduces after every micro-batch, overlapping the next one.
  bool deterministic = false;
  // With a pipeline: after step `timeline_step` (1-based; 0 = never) draw its measured timeline in
  // `timeline_path` (SVG), written by the rank that passes `lead`.
  int64_t timeline_step = 0;
  std::string timeline_path;
  bool lead = false;
};

class TrainStep {
 public:
  TrainStep(models::ModelParts& parts, TrainStepOptions options);
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // Forward and backward of step `step` (0-based) on this rank's rows: gradients accumulate as for
  // one backward of the mean loss over the micro-batches. Returns that mean loss.
  double forward_backward(int64_t step, const at::Tensor& inputs, const at::Tensor& targets);
  // The same mean loss without autograd.
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);
  // The model's output for `inputs` as one micro-batch, as a plain tensor on every rank (for
  // generation).
  at::Tensor logits(const at::Tensor& inputs);

 private:
  void draw_timeline(int64_t step) const;
  models::ModelParts& parts_;
  TrainStepOptions options_;
};

}  // namespace hp::train
