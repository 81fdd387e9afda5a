// Running a pipeline schedule: each rank executes its program of actions on the stages it hosts,
// with activations and gradients passed by point-to-point messages between stage ranks.
//
//   auto stages = hp::models::split_llama(model, {2, 2});        // stage modules (layer ranges)
//   hp::pp::PipelineExecutor pipe(hp::pp::one_f_one_b(2, 4), {{stages[rank], rank}}, world, loss_fn);
//   double loss = pipe.step(tokens, targets);                    // forward + backward of one batch
//   optimizer.step();                                            // each rank steps its stages' parameters
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/nn/module.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

// The loss of one micro-batch from the last stage's output and the micro-batch's targets.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

struct PipelineStage {
  std::shared_ptr<nn::Module> module;
  int index;  // stage index in the schedule
};

class PipelineExecutor {
 public:
  // `stages`: the stages this rank hosts (schedule.stage_rank says which). `group`: the pipeline's
  // ranks; group rank r runs schedule.programs[r]. Validates the schedule.
  PipelineExecutor(Schedule schedule, std::vector<PipelineStage> stages, comm::ProcessGroup group, LossFn loss);

  // One forward and backward of the whole batch (activation shapes cross each stage boundary on the
  // first step; later steps must keep the micro-batch shape, which is checked): `inputs` and `targets` (the same on every rank;
  // stage 0 reads inputs, the last stage targets) are split into the schedule's micro-batches along
  // dim 0. Gradients accumulate into the stages' parameters as for one backward of the mean loss
  // over micro-batches. Returns that mean loss on every rank. Collective over `group`.
  double step(const at::Tensor& inputs, const at::Tensor& targets);

  // Forward only, without autograd: the mean loss over the micro-batches, on every rank. Collective.
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);

  // Inference on `inputs` as one micro-batch, stage after stage (shapes travel with the data, so
  // they may change from call to call): the last stage's output, on every rank. Collective.
  at::Tensor forward(const at::Tensor& inputs);

  // When on, step() records when each action of this rank ran (seconds on the steady clock, the
  // same on every process of a machine), for measured bubbles and timelines (to_svg).
  void record_timeline(bool on) { record_ = on; }
  const std::vector<TimedAction>& last_timeline() const { return timeline_; }

  // The most micro-batches whose activations a stage held at once during the last step.
  int peak_live_micro_batches(int stage) const;

 private:
  struct Slot;
  double run(const at::Tensor& inputs, const at::Tensor& targets, bool backward);
  const PipelineStage& stage(int index) const;
  Schedule schedule_;
  std::vector<PipelineStage> stages_;
  comm::ProcessGroup group_;
  LossFn loss_;
  std::map<int, at::Tensor> received_description_;     // per stage: dtype and shape of its input (exchanged once)
  std::map<int, std::vector<int64_t>> sent_shape_;      // per stage: the output shape sent (once)
  std::map<int, int> peak_live_;
  bool record_ = false;
  std::vector<TimedAction> timeline_;
};

}  // namespace hp::pp
