// log.profile_step: where rank 0's time in one training step goes, by class of ATen op and by op,
// hp's own kernels included (hp/core/op_timer.h), written to run_dir/profile.txt and summarised in
// the log.
#pragma once

#include <cstdint>
#include <memory>

#include "hp/core/op_timer.h"
#include "hp/train/config.h"

namespace hp::train::detail {

class StepProfile {
 public:
  // Times this thread's ops from here until finish(), when `profiled`.
  explicit StepProfile(bool profiled);
  ~StepProfile();
  // Stops timing; with `profiled`, writes the report of step `step` that took `seconds`.
  void finish(const TrainConfig& c, int64_t step, double seconds);

 private:
  std::unique_ptr<OpTimer> timer_;
  std::unique_ptr<DispatchModeGuard> timing_;
  std::unique_ptr<KernelObserverGuard> timing_kernels_;
};

}  // namespace hp::train::detail
