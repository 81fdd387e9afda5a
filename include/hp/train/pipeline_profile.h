// What hp-train measured of a pipeline's costs and bubbles (parallel.pp_costs: measured).
#pragma once

#include <cstdint>

#include "hp/pp/schedule.h"

namespace hp::train {

// What the profiled step measured, and what the schedule built for it predicts and gives.
struct PipelineProfile {
  pp::ActionCosts costs;           // seconds
  int64_t step = 0;                // the profiled step (1-based): the second this process runs
  double predicted_bubble = 0.0;   // of the order built for `costs`, simulated under them
  double unit_order_bubble = 0.0;  // of the unit-cost order the profiled step ran, simulated under them
  double profiled_bubble = 0.0;    // measured in the profiled step
  bool rescheduled = false;        // whether the order built for `costs` replaced the unit-cost one
                                   // (it must predict at least 5% less bubble)
  double measured_bubble = -1.0;   // measured in the step after (-1: the run ended first)
};

}  // namespace hp::train
