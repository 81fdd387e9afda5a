#include "pp/candidates.h"

#include <limits>
#include <utility>

#include "hp/core/error.h"

namespace hp::pp {

Schedule empty_schedule(const std::string& name, int ranks, int micro_batches, bool v_shape) {
  HP_CHECK(ranks >= 1 && micro_batches >= 1, "pp: ", name, " needs ranks >= 1 and micro_batches >= 1, got ", ranks,
           " and ", micro_batches);
  Schedule s;
  s.name = name;
  s.ranks = ranks;
  s.stages = v_shape ? 2 * ranks : ranks;
  s.micro_batches = micro_batches;
  for (int stage = 0; stage < s.stages; ++stage) s.stage_rank.push_back(stage < ranks ? stage : s.stages - 1 - stage);
  return s;
}

Schedule lowest_bubble(std::vector<Schedule> candidates, const ActionCosts& costs) {
  size_t best = 0;
  double lowest = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < candidates.size(); ++i) {
    const double bubble = simulate(candidates[i], costs).bubble;
    if (bubble < lowest - 1e-12) lowest = bubble, best = i;
  }
  return std::move(candidates[best]);
}

bool unit_costs(const ActionCosts& c) {
  return c.forward == 1 && c.backward_input == 1 && c.backward_weight == 1 && c.send == 0 && c.overhead == 0 &&
         c.by_stage.empty();
}

}  // namespace hp::pp
