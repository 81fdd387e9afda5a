// The automatic memory strategy (train/memory_budget.h).
#include "train/memory_budget.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <iomanip>
#include <numeric>
#include <sstream>
#include <utility>

#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/models/model_spec.h"
#include "hp/train/dry_run.h"
#include "train/layout_step.h"

namespace hp::train::detail {
namespace {

// A plan's predicted peak times this stays under the budget: the measured peak of a step can be up
// to 3% above its dry run's where collectives run asynchronously (docs/planning.md#accuracy).
constexpr double kMargin = 1.05;
// Candidates checked by a dry run of their own, cheapest first, before the strategy settles for
// the cheapest mode that fits every block.
constexpr int kDryRunsOfCandidates = 8;

std::string mib(double bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << bytes / (1 << 20) << " MiB";
  return out.str();
}

std::string ms(double seconds) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2) << seconds * 1e3 << " ms";
  return out.str();
}

std::string listed(const std::vector<std::string>& blocks) {
  std::string out = "[";
  for (size_t i = 0; i < blocks.size(); ++i) out += (i ? ", " : "") + blocks[i];
  return out + "]";
}

// The layers of each pipeline stage, in stage order (one stage without pipeline parallelism).
std::vector<int64_t> stage_layers(const TrainConfig& c) {
  if (!c.pp_layers_per_stage.empty()) return c.pp_layers_per_stage;
  const int64_t stages = c.parallel.pp > 1 ? c.pipeline_stages() : 1;
  return std::vector<int64_t>(stages, c.model->layers() / stages);
}

// Within each stage, counts[m] blocks of modes[m] in that order from its first block, the rest none.
std::vector<std::string> assign(const std::vector<int64_t>& stages, const std::vector<std::string>& modes,
                                const std::vector<int64_t>& counts) {
  std::vector<std::string> blocks;
  for (const int64_t layers : stages) {
    int64_t placed = 0;
    for (size_t m = 0; m < modes.size(); ++m)
      for (int64_t k = 0; k < counts[m] && placed < layers; ++k, ++placed) blocks.push_back(modes[m]);
    for (; placed < layers; ++placed) blocks.push_back("none");
  }
  return blocks;
}

TrainConfig with_blocks(const TrainConfig& c, std::vector<std::string> blocks) {
  TrainConfig planned = c;
  planned.memory.budget_mb = 0;
  planned.memory.blocks = std::move(blocks);
  return planned;
}

// The dry-run peak of `c` with `blocks`: the largest of world rank 0's pipeline positions'.
int64_t predicted_peak(const TrainConfig& c, int world_size, std::vector<std::string> blocks) {
  int64_t peak = 0;
  for (const DryRunReport& report : dry_run_pipeline(with_blocks(c, std::move(blocks)), world_size, 0))
    peak = std::max(peak, report.peak_bytes);
  return peak;
}

// What each of `modes` (modes[0] is "full") adds to a step per block and micro-batch: one profiled
// step (after one that warms up) of `c`'s layout on `world` with block i in modes[i mod M] (and
// again with the modes rotated, where there are fewer blocks than modes). Every rank returns the
// same costs: the sums over the ranks' blocks, as rank 0 has them.
std::vector<double> profile(const TrainConfig& c, const comm::ProcessGroup& world,
                            const std::vector<std::string>& modes) {
  const int64_t layers = c.model->layers(), count = static_cast<int64_t>(modes.size());
  // By mode: forward seconds, recomputation seconds, blocks timed (this rank's).
  at::Tensor sums = at::zeros({count, 3}, at::kDouble);
  for (int64_t rotation = 0; rotation * layers < count; ++rotation) {
    std::vector<std::string> blocks;
    for (int64_t i = 0; i < layers; ++i) blocks.push_back(modes[(i + rotation * layers) % count]);
    LayoutStep step(with_blocks(c, blocks), world);
    step.run(c.per_rank_batch());  // first allocations, kernels' first calls
    step.run(c.per_rank_batch());
    const auto& checkpointed = step.parts().checkpointed;  // every block, in layer order
    HP_CHECK(static_cast<int64_t>(checkpointed.size()) == layers, "memory.budget_mb: the profiled step checkpointed ",
             checkpointed.size(), " of ", layers, " blocks");
    for (int64_t i = 0; i < layers; ++i) {
      const CheckpointStats& stats = checkpointed[i].second.stats();
      if (stats.forward_seconds == 0.0) continue;  // another pipeline stage's block
      at::Tensor row = sums[(i + rotation * layers) % count];
      row[0] += stats.forward_seconds;
      row[1] += stats.recompute_seconds;
      row[2] += 1.0;
    }
  }
  sums = world.broadcast(world.all_reduce(sums), 0);
  const auto mean = [&](int64_t m, int64_t column) {
    return sums[m][column].item<double>() / std::max(1.0, sums[m][2].item<double>());
  };
  std::vector<double> costs;
  for (int64_t m = 0; m < count; ++m) costs.push_back(std::max(0.0, mean(m, 0) + mean(m, 1) - mean(0, 0)));
  return costs;
}

struct Candidate {
  std::vector<int64_t> counts;  // per stage, of each mode
  double seconds = 0.0;         // per micro-batch
  double estimated_peak = 0.0;  // from the uniform dry runs
};

// Every split of up to `layers` blocks among the modes whose estimated peak (linear in the blocks
// between none's peak and each mode's) is at most `target`, cheapest first.
std::vector<Candidate> candidates(int64_t layers, double none_peak, const std::vector<double>& saving_per_block,
                                  const std::vector<double>& costs, double target) {
  std::vector<Candidate> out;
  std::vector<int64_t> counts(costs.size(), 0);
  const auto visit = [&](const auto& self, size_t m, int64_t left) -> void {
    if (m == counts.size()) {
      Candidate c{counts, 0.0, none_peak};
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
  visit(visit, 0, layers);
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    return a.seconds != b.seconds ? a.seconds < b.seconds : a.estimated_peak < b.estimated_peak;
  });
  return out;
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& c, const comm::ProcessGroup& world) {
  HP_CHECK(c.memory.budget_mb > 0, "plan_memory: memory.budget_mb is not set");
  const int64_t layers = c.model->layers();
  const double budget = static_cast<double>(c.memory.budget_mb) * (1 << 20), target = budget / kMargin;
  const std::vector<int64_t> stages = stage_layers(c);
  std::ostringstream report;
  report << "memory.budget_mb " << c.memory.budget_mb << ": plans keep the dry run's step peak under " << mib(target)
         << " (the budget less a " << std::setprecision(2) << (kMargin - 1) * 100 << "% margin)\n";
  MemoryPlan plan;
  const int64_t none_peak = predicted_peak(c, world.size(), std::vector<std::string>(layers, "none"));
  report << "  without checkpointing: " << mib(static_cast<double>(none_peak));
  if (static_cast<double>(none_peak) <= target) {
    plan.blocks.assign(layers, "none");
    plan.peak_bytes = none_peak;
    plan.report = report.str() + ", which fits: no block is checkpointed";
    return plan;
  }
  report << "\n";

  // The modes, those that keep the least first.
  std::vector<std::string> modes = {"full", "selective"};
  if (c.memory.swap != "none") modes.push_back("swap");
  std::vector<int64_t> uniform_peaks;
  for (const std::string& mode : modes)
    uniform_peaks.push_back(predicted_peak(c, world.size(), std::vector<std::string>(layers, mode)));
  std::vector<size_t> order(modes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return uniform_peaks[a] < uniform_peaks[b]; });
  HP_CHECK(static_cast<double>(uniform_peaks[order.front()]) <= target, "memory.budget_mb ", c.memory.budget_mb,
           " is below what any plan needs: ", modes[order.front()], " checkpointing of every block peaks at ",
           mib(static_cast<double>(uniform_peaks[order.front()])), " (dry run), ", mib(target),
           " at most with the margin; raise the budget, shard more (parallel.*), or offload (memory.offload)");
  const std::vector<double> measured = profile(c, world, modes);
  const int64_t largest_stage = *std::max_element(stages.begin(), stages.end());
  std::vector<std::string> sorted_modes;
  std::vector<double> costs, saving;
  report << "  every block (dry run; measured cost per block and micro-batch):";
  for (size_t m : order) {
    sorted_modes.push_back(modes[m]);
    costs.push_back(measured[m]);
    saving.push_back(static_cast<double>(none_peak - uniform_peaks[m]) / static_cast<double>(largest_stage));
    report << " " << modes[m] << " " << mib(static_cast<double>(uniform_peaks[m])) << " +" << ms(measured[m]) << ";";
  }
  report << "\n";

  const auto chosen = [&](const std::vector<int64_t>& counts, int64_t peak) {
    plan.blocks = assign(stages, sorted_modes, counts);
    plan.peak_bytes = peak;
    plan.seconds_per_micro_batch = 0.0;
    for (size_t m = 0; m < counts.size(); ++m)
      plan.seconds_per_micro_batch += static_cast<double>(counts[m] * static_cast<int64_t>(stages.size())) * costs[m];
    report << "  plan: memory.blocks " << listed(plan.blocks) << ": peak " << mib(static_cast<double>(peak))
           << " (dry run), recomputation and copies about " << ms(plan.seconds_per_micro_batch) << " per micro-batch"
           << (stages.size() > 1 ? " (its stages together)" : "");
    plan.report = report.str();
    return plan;
  };
  int tried = 0;
  for (const Candidate& candidate : candidates(largest_stage, static_cast<double>(none_peak), saving, costs, target)) {
    if (tried++ == kDryRunsOfCandidates) break;
    const int64_t peak = predicted_peak(c, world.size(), assign(stages, sorted_modes, candidate.counts));
    if (static_cast<double>(peak) <= target) return chosen(candidate.counts, peak);
  }
  // The cheapest mode that fits in every block (the least-keeping one does).
  size_t fallback = 0;
  for (size_t m = 1; m < sorted_modes.size(); ++m)
    if (static_cast<double>(uniform_peaks[order[m]]) <= target && costs[m] < costs[fallback]) fallback = m;
  std::vector<int64_t> counts(sorted_modes.size(), 0);
  counts[fallback] = largest_stage;
  return chosen(counts, uniform_peaks[order[fallback]]);
}

TrainConfig with_memory_plan(const TrainConfig& c, const comm::ProcessGroup& world) {
  const MemoryPlan plan = plan_memory(c, world);
  if (world.rank() == 0) log::info(plan.report);
  return with_blocks(c, plan.blocks);
}

}  // namespace hp::train::detail
