// Rerun on an anomaly (resilience.rerun_on_anomaly, docs/resilience.md#rerun-on-anomaly): which
// steps run again, and what the rerun says of them. A step recomputes bitwise from the same
// parameters, batch and random state, so the same numbers twice point at the data or the model,
// and other numbers at a transient fault of the hardware.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>

#include "hp/dtensor/random.h"
#include "hp/models/model_parts.h"
#include "hp/train/callbacks.h"

namespace hp::train::detail {

// Which steps are anomalies: a global loss or gradient norm that is not finite or, with a spike
// factor F > 0, above F times the largest of the previous steps' (the last kWindow finite ones;
// none before kFewest of them).
class AnomalyWatch {
 public:
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

// The trainer's side: every rank holds one, fed the same global numbers, so all decide alike.
class StepRerun {
 public:
  // spike_factor as AnomalyWatch's; `mesh` and `parts` are what a rerun rewinds.
  StepRerun(double spike_factor, const DeviceMesh& mesh, models::ModelParts& parts);

  // When `record` (a step's first run) is an anomaly: the step's random state goes back to
  // `step_start_rng` and the model forgets what its first run counted (ModelParts::forget_step),
  // `run_again` recomputes the step into `record`, and record.rerun says what that showed. Returns
  // the sentence that says so, for the log and errors; nullopt (nothing run) for a sound step.
  std::optional<std::string> rerun_if_anomalous(StepRecord& record, const MeshRngState& step_start_rng,
                                                const std::function<void()>& run_again);
  // The step of `record` goes on (AnomalyWatch::note).
  void note(const StepRecord& record) { watch_.note(record); }

 private:
  AnomalyWatch watch_;
  const DeviceMesh& mesh_;
  models::ModelParts& parts_;
};

}  // namespace hp::train::detail
