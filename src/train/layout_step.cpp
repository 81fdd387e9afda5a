// A layout's training step on random tokens, without the trainer (train/layout_step.h).
#include "train/layout_step.h"

#include <ATen/CPUGeneratorImpl.h>

#include "hp/models/model_spec.h"
#include "hp/nn/token_coordinates.h"
#include "hp/optim/clip_grad.h"
#include "train/work_recorder.h"

namespace hp::train::detail {

LayoutStep::LayoutStep(const TrainConfig& config, const comm::ProcessGroup& world, int64_t micro_batches)
    : c_(config), world_(world) {
  validate(c_, world_.size());
  s_ = std::make_unique<Setup>(build(c_, world_));
  s_->parts.init_parameters(c_.seed, s_->mesh.device());
  optimizer_ = make_optimizer(c_, s_->parts, s_->parts.parameters());
  TrainStepOptions options;
  options.micro_batches = micro_batches > 0 ? micro_batches : c_.micro_batches();
  options.deterministic = c_.train.deterministic;
  options.world = world_;
  step_ = std::make_unique<TrainStep>(s_->parts, options);
  counted_ = s_->parts.counted_parameters();
  copies_ = s_->parts.copied_parameters();
}

void LayoutStep::run(int64_t rows, WorkRecorder* recorder) {
  at::Generator tokens = at::detail::createCPUGenerator(c_.seed + 1 + static_cast<uint64_t>(step_number_));
  const auto draw = [&] {
    return at::randint(c_.model->vocab(), {rows, c_.data.seq_len}, tokens, at::kLong).to(s_->mesh.device());
  };
  const at::Tensor x = draw(), y = draw();
  optimizer_->zero_grad();
  {
    const nn::TokenCoordinatesScope where(s_->coordinates(c_, step_number_, 0));
    step_->forward_backward(step_number_++, s_->shard_sequence(x), s_->shard_sequence(y));
  }
  if (recorder != nullptr) recorder->set_optimizer_phase(true);
  clip_grad_norm_(counted_, c_.train.max_grad_norm > 0 ? c_.train.max_grad_norm : 1e30, world_, 2.0, copies_);
  optimizer_->step();
}

}  // namespace hp::train::detail
