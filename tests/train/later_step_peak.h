// A callback keeping a rank's largest peak_mem_bytes of the steps after the first (the first has no
// optimizer state yet): what a dry run's peak predicts; and the steps' losses. For tests and
// bench_plan.
#pragma once

#include <algorithm>
#include <vector>

#include "hp/train/callbacks.h"

namespace hp::train {

struct LaterStepPeak : Callback {
  double bytes = 0.0;
  std::vector<double> losses;  // every step's global training loss, in order
  void on_step_end(const StepRecord& record) override {
    if (record.step > 1) bytes = std::max(bytes, record.peak_mem_bytes);
    losses.push_back(record.loss);
  }
};

}  // namespace hp::train
