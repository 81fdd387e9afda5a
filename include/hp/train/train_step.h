// One training step's forward and backward over a rank's rows of the batch, whatever the model's
// parallel layout: the one place in the trainer that knows whether the model runs whole on this
// rank (gradient accumulation over micro-batches) or as pipeline stages (the schedule splits the
// rows into its micro-batches). The loop, evaluation and generation go through it.
//
// Collective: with a pipeline, every rank of the pipeline calls each method in the same order.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "hp/comm/process_group.h"
#include "hp/models/model_parts.h"
#include "hp/train/pipeline_profile.h"

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
  // With a pipeline: build schedule `schedule_name` (schedule_by_name, with `stages_per_rank`) for
  // the costs the second step of this process measures (the first also exchanges shapes), and run
  // it from the third on when it predicts at least 5% (relative) less bubble. Those two steps
  // gather their timelines; the trainer leaves them out of its throughput. The costs of the first
  // rank of `world` (one broadcast) order every pipeline of the job alike, so the data-parallel
  // ranks of a stage issue their collectives in the same order.
  bool schedule_for_measured_costs = false;
  std::string schedule_name;
  int stages_per_rank = 2;
  comm::ProcessGroup world;
};

class TrainStep {
 public:
  TrainStep(models::ModelParts& parts, TrainStepOptions options);
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // Forward and backward of step `step` (0-based) on this rank's rows: gradients accumulate as for
  // one backward of the mean loss over the micro-batches. Returns that mean loss. The same step may
  // run again (from the same parameters and random state, its gradients zeroed): it runs the same
  // pipeline order and computes the same numbers.
  double forward_backward(int64_t step, const at::Tensor& inputs, const at::Tensor& targets);
  // The same mean loss without autograd.
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);
  // The model's output for `inputs` as one micro-batch, as a plain tensor on every rank (for
  // generation).
  at::Tensor logits(const at::Tensor& inputs);
  // After the profiled step, with TrainStepOptions::schedule_for_measured_costs.
  const std::optional<PipelineProfile>& pipeline_profile() const { return profile_; }
  // Whether step `step` (0-based) of a run that started at `first_step` is one of the profiling
  // steps above.
  bool profiles(int64_t step, int64_t first_step) const { return profiles_nth(step - first_step + 1); }

 private:
  // Whether this process's `nth` step (1-based) profiles: the second measures, the third checks.
  bool profiles_nth(int64_t nth) const { return options_.schedule_for_measured_costs && (nth == 2 || nth == 3); }
  void draw_timeline(int64_t step, const pp::Simulation& measured) const;
  void schedule_for(const pp::Simulation& measured, int64_t step);
  void record_bubble(const pp::Simulation& measured, int64_t step);
  models::ModelParts& parts_;
  TrainStepOptions options_;
  int64_t steps_run_ = 0;                   // by this process (a resumed run profiles its own second step)
  int64_t last_step_ = -1;                  // the step forward_backward ran last
  std::optional<pp::Schedule> next_order_;  // ordered for the profiled step's costs; runs from the next step
  std::optional<PipelineProfile> profile_;
};

}  // namespace hp::train
