// The search behind memory.budget_mb, without ranks or dry runs (train/block_plan_search.h).
#include "train/block_plan_search.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "hp/core/error.h"
#include "hp/models/model_spec.h"
#include "hp/pp/schedule.h"

namespace hp::train::detail {

std::vector<int64_t> stage_layers(const TrainConfig& c) {
  if (c.parallel.pp == 1) return {c.model->layers()};
  if (!c.pp_layers_per_stage.empty()) return c.pp_layers_per_stage;
  const int64_t stages = c.pipeline_stages();
  return std::vector<int64_t>(stages, c.model->layers() / stages);
}

std::vector<PipelinePosition> positions_of(const TrainConfig& c, const std::vector<int64_t>& stages) {
  std::vector<PipelinePosition> positions(c.parallel.pp);
  std::vector<int> stage_rank(stages.size(), 0);
  if (c.parallel.pp > 1)
    stage_rank = pp::schedule_by_name(c.pp_schedule, static_cast<int>(c.parallel.pp),
                                      static_cast<int>(c.micro_batches()), static_cast<int>(c.pp_stages_per_rank))
                     .stage_rank;
  for (size_t s = 0; s < stages.size(); ++s) {
    PipelinePosition& at = positions.at(stage_rank[s]);
    at.stages.push_back(s);
    at.largest = std::max(at.largest, stages[s]);
  }
  return positions;
}

std::vector<std::string> assign(const std::vector<int64_t>& stages, const std::vector<std::string>& modes,
                                const std::vector<std::vector<int64_t>>& counts) {
  std::vector<std::string> blocks;
  for (size_t s = 0; s < stages.size(); ++s) {
    int64_t placed = 0;
    for (size_t m = 0; m < modes.size(); ++m)
      for (int64_t k = 0; k < counts[s][m] && placed < stages[s] - 1; ++k, ++placed) blocks.push_back(modes[m]);
    for (; placed < stages[s]; ++placed) blocks.push_back("none");
  }
  return blocks;
}

std::vector<std::vector<std::string>> round_robin(int64_t layers, const std::vector<std::string>& modes) {
  const int64_t count = static_cast<int64_t>(modes.size());
  std::vector<std::vector<std::string>> steps;
  for (int64_t rotation = 0; rotation * layers < count; ++rotation) {
    steps.emplace_back();
    for (int64_t i = 0; i < layers; ++i) steps.back().push_back(modes[(i + rotation * layers) % count]);
  }
  return steps;
}

int64_t blocks_to_time(const std::string& mode) { return mode == "swap" ? 2 : 1; }

std::vector<std::string> fewest_blocks(const std::vector<int64_t>& stages, const std::vector<std::string>& modes) {
  const int64_t layers = std::accumulate(stages.begin(), stages.end(), int64_t{0});
  std::vector<std::string> timed;
  for (size_t m = 1; m < modes.size(); ++m) timed.insert(timed.end(), blocks_to_time(modes[m]), modes[m]);
  const int64_t others = static_cast<int64_t>(timed.size());
  HP_CHECK(others < layers, "memory.budget_mb: ", layers, " blocks cannot time ", modes.size(), " modes");
  const int64_t start = std::min(layers - stages.back(), layers - others);
  std::vector<std::string> blocks(layers, modes.front());
  std::copy(timed.begin(), timed.end(), blocks.begin() + start);
  return blocks;
}

std::vector<BlockSplit> candidates(int64_t blocks, double none_peak, const std::vector<double>& saving_per_block,
                                   const std::vector<double>& costs, double target) {
  std::vector<BlockSplit> out;
  std::vector<int64_t> counts(costs.size(), 0);
  const auto visit = [&](const auto& self, size_t m, int64_t left) -> void {
    if (m == counts.size()) {
      BlockSplit c{counts, 0.0, none_peak};
      for (size_t k = 0; k < counts.size(); ++k) {
        c.seconds += static_cast<double>(counts[k]) * costs[k];
        c.estimated_peak -= static_cast<double>(counts[k]) * saving_per_block[k];
      }
      if (c.estimated_peak <= target) out.push_back(std::move(c));
      return;
    }
    for (counts[m] = 0; counts[m] <= left; ++counts[m]) self(self, m + 1, left - counts[m]);
    counts[m] = 0;
  };
  visit(visit, 0, blocks);
  // Equal costs (a mode measured at no cost, its noise clamped to 0): the split that changes fewest
  // blocks, then the lower peak.
  const auto changed = [](const BlockSplit& s) {
    return std::accumulate(s.counts.begin(), s.counts.end(), int64_t{0});
  };
  std::stable_sort(out.begin(), out.end(), [&](const BlockSplit& a, const BlockSplit& b) {
    if (a.seconds != b.seconds) return a.seconds < b.seconds;
    if (changed(a) != changed(b)) return changed(a) < changed(b);
    return a.estimated_peak < b.estimated_peak;
  });
  return out;
}

}  // namespace hp::train::detail
