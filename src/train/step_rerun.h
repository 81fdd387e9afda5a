// Rerun on an anomaly (resilience.rerun_on_anomaly, docs/resilience.md#rerun-on-anomaly): which
// steps run again, and what the rerun says of them. A step recomputes bitwise from the same
// parameters, batch and random state, so the same numbers twice point at the data or the model,
// and other numbers at a transient fault of the hardware.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "hp/train/callbacks.h"

namespace hp::train::detail {

class AnomalyWatch {
 public:
  // spike_factor: a loss or gradient norm above this times the largest of the previous steps' is
  // a spike (0: only non-finite numbers are anomalies).
  explicit AnomalyWatch(double spike_factor);

  // Why the step of `record` (its global loss and gradient norm) is an anomaly, or nullopt.
  std::optional<std::string> anomaly(const StepRecord& record) const;
  // The step of `record` goes on: its finite numbers join the window the next steps are compared
  // with (a persistent spike too: it is what the data does).
  void note(const StepRecord& record);

  static constexpr size_t kWindow = 10;  // steps
  static constexpr size_t kFewest = 3;   // previous steps before spikes are looked for

 private:
  double spike_factor_;
  std::deque<double> losses_, grad_norms_;
};

// Whether two runs of a step gave the same global loss and gradient norm: bitwise, or both NaN.
bool same_numbers(const StepRecord& first, const StepRecord& rerun);

// What the rerun of `step` (1-based), an anomaly for `why` (AnomalyWatch::anomaly), says, in a
// sentence for the log and errors.
std::string describe_rerun(int64_t step, const std::string& why, const StepRecord& first, const StepRecord& rerun);

}  // namespace hp::train::detail
