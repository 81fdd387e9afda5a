// Learning-rate schedules: linear warmup, then cosine, linear, warmup-stable-decay (WSD) or
// constant, applied to every parameter group of a torch::optim optimizer as a factor of the
// group's base rate.
//
//   auto scheduler = hp::get_hyper_lr_scheduler(optimizer, {.warmup_steps = 100, .total_steps = 10000});
//   for (...) { ...; optimizer.step(); scheduler.step(); }
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace hp {

struct LRSchedule {
  enum class Decay { kCosine, kLinear, kWsd, kConstant };
  int64_t warmup_steps = 0;  // factor rises linearly to 1 over these steps: (step + 1) / warmup
  int64_t total_steps = 1;   // decay ends here
  Decay decay = Decay::kCosine;
  double min_lr_ratio = 0.0;    // the factor decays to this
  double decay_fraction = 0.1;  // WSD: the last fraction of total_steps decays linearly
};

LRSchedule::Decay parse_decay(const std::string& name);  // "cosine", "linear", "wsd", "constant"

class LRScheduler {
 public:
  // Base rates are the groups' rates now: build the scheduler on a freshly made optimizer. To
  // resume, build both as at the start, load the optimizer's state, then set_step(saved step).
  // Each group at its own base rate (a ChainedOptimizer's Muon and AdamW groups alike).
  LRScheduler(torch::optim::Optimizer& optimizer, LRSchedule schedule);

  // The factor of the base rate at `step` (0 = the first optimizer step).
  double factor(int64_t step) const;
  // Advances one step and sets every group's rate to base rate x factor(next step).
  void step();
  int64_t last_step() const { return step_; }
  // Restores the position (e.g. after loading a checkpoint) and sets the rates for it.
  void set_step(int64_t step);
  double lr(size_t group = 0) const;

 private:
  void apply();
  torch::optim::Optimizer* optimizer_;
  LRSchedule schedule_;
  std::vector<double> base_lrs_;
  int64_t step_ = 0;
};

LRScheduler get_hyper_lr_scheduler(torch::optim::Optimizer& optimizer, LRSchedule schedule);

}  // namespace hp
