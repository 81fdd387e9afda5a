// What the zero-bubble builders share: an empty schedule to place actions in, and the choice of
// the order that idles least among a builder's candidates.
#pragma once

#include <string>
#include <vector>

#include "hp/pp/schedule.h"

namespace hp::pp {

// A schedule with stages placed and no actions: one stage per rank, or two in a V (rank r holds
// stages r and 2 ranks - 1 - r).
Schedule empty_schedule(const std::string& name, int ranks, int micro_batches, bool v_shape);

// The candidate with the lowest simulated bubble under `costs` (the first of equals).
Schedule lowest_bubble(std::vector<Schedule> candidates, const ActionCosts& costs);

// Whether `costs` are the defaults: F = I = W = 1, no send latency, no overhead, no per-stage values.
bool unit_costs(const ActionCosts& costs);

// A builder's order for `costs`, unless its order for unit costs idles no more under `costs` (a W
// that would overrun its gap by a little stays out of it, which can cost more than it saves).
// `build(costs, out)` appends its candidates for `costs` to `out`.
template <typename Build>
Schedule for_costs(const Build& build, const ActionCosts& costs) {
  std::vector<Schedule> candidates;
  build(ActionCosts{}, candidates);  // first: the unit order wins ties
  if (!unit_costs(costs)) build(costs, candidates);
  return lowest_bubble(std::move(candidates), costs);
}

}  // namespace hp::pp
