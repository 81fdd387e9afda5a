#include "hp/optim/lr_scheduler.h"

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>

#include "hp/core/error.h"

namespace hp {

LRSchedule::Decay parse_decay(const std::string& name) {
  if (name == "cosine") return LRSchedule::Decay::kCosine;
  if (name == "linear") return LRSchedule::Decay::kLinear;
  if (name == "wsd") return LRSchedule::Decay::kWsd;
  if (name == "constant") return LRSchedule::Decay::kConstant;
  HP_FAIL("LR schedule: unknown decay '", name, "'; use cosine, linear, wsd or constant");
}

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer, LRSchedule schedule)
    : optimizer_(&optimizer), schedule_(schedule) {
  HP_CHECK(schedule.warmup_steps >= 0 && schedule.total_steps > 0 && schedule.warmup_steps <= schedule.total_steps,
           "LR schedule: need 0 <= warmup_steps (", schedule.warmup_steps, ") <= total_steps (", schedule.total_steps,
           ")");
  HP_CHECK(schedule.min_lr_ratio >= 0.0 && schedule.min_lr_ratio <= 1.0,
           "LR schedule: min_lr_ratio must be in [0, 1], got ", schedule.min_lr_ratio);
  HP_CHECK(schedule.decay_fraction > 0.0 && schedule.decay_fraction <= 1.0,
           "LR schedule: decay_fraction must be in (0, 1], got ", schedule.decay_fraction);
  for (const auto& group : optimizer_->param_groups()) base_lrs_.push_back(group.options().get_lr());
  apply();
}

double LRScheduler::factor(int64_t step) const {
  const LRSchedule& s = schedule_;
  if (step < s.warmup_steps) return static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  const double low = s.min_lr_ratio;
  const double decay_steps = static_cast<double>(std::max<int64_t>(1, s.total_steps - s.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / decay_steps);
  switch (s.decay) {
    case LRSchedule::Decay::kCosine:
      return low + (1.0 - low) * 0.5 * (1.0 + std::cos(M_PI * progress));
    case LRSchedule::Decay::kLinear:
      return 1.0 - (1.0 - low) * progress;
    case LRSchedule::Decay::kConstant:
      return 1.0;
    case LRSchedule::Decay::kWsd: {
      const double decay_start = s.total_steps - s.decay_fraction * s.total_steps;
      if (step < decay_start) return 1.0;
      const double into = std::min(1.0, (step - decay_start) / (s.total_steps - decay_start));
      return 1.0 - (1.0 - low) * into;
    }
  }
  return 1.0;
}

void LRScheduler::apply() {
  const double f = factor(step_);
  size_t i = 0;
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(base_lrs_.at(i++) * f);
}

void LRScheduler::step() {
  ++step_;
  apply();
}

void LRScheduler::set_step(int64_t step) {
  HP_CHECK(step >= 0, "LRScheduler::set_step: step must be non-negative, got ", step);
  step_ = step;
  apply();
}

double LRScheduler::lr(size_t group) const {
  const auto& groups = optimizer_->param_groups();
  HP_CHECK(group < groups.size(), "LRScheduler::lr: no parameter group ", group, " (the optimizer has ", groups.size(),
           ")");
  return groups[group].options().get_lr();
}

LRScheduler get_hyper_lr_scheduler(torch::optim::Optimizer& optimizer, LRSchedule schedule) {
  return LRScheduler(optimizer, schedule);
}

}  // namespace hp
