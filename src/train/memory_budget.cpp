// The automatic memory strategy (train/memory_budget.h).
#include "train/memory_budget.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <iomanip>
#include <numeric>
#include <sstream>
#include <utility>

#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/models/model_spec.h"
#include "hp/train/dry_run.h"
#include "train/block_plan_search.h"
#include "train/layout_step.h"

namespace hp::train::detail {
namespace {

// A plan's predicted peak times this stays under the budget: the measured peak of a step can be up
// to 3% above its dry run's where collectives run asynchronously (docs/planning.md#accuracy).
constexpr double kMargin = 1.05;
// Candidates checked by a dry run of their own, cheapest first, before the strategy settles for
// full checkpointing.
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

TrainConfig with_blocks(const TrainConfig& c, std::vector<std::string> blocks) {
  TrainConfig planned = c;
  planned.memory.budget_mb = 0;
  planned.memory.blocks = std::move(blocks);
  return planned;
}

// The dry-run peaks of `c` with `blocks`, by pipeline position of world rank 0's pipeline.
std::vector<int64_t> predicted_peaks(const TrainConfig& c, int world_size, std::vector<std::string> blocks) {
  std::vector<int64_t> peaks;
  for (const DryRunReport& report : dry_run_pipeline(with_blocks(c, std::move(blocks)), world_size, 0))
    peaks.push_back(report.peak_bytes);
  return peaks;
}

int64_t largest(const std::vector<int64_t>& peaks) { return *std::max_element(peaks.begin(), peaks.end()); }

// Runs `local` (work without collectives) on every rank of `world`; where it throws on any rank,
// every rank throws: its own error, or one naming the ranks that failed. So a failure on one rank
// (its file tier's directory, say) does not leave the others waiting in the profile's collectives.
template <typename Local>
auto agreed(const comm::ProcessGroup& world, Local&& local) {
  std::exception_ptr failure;
  decltype(local()) result{};
  try {
    result = local();
  } catch (...) {
    failure = std::current_exception();
  }
  const at::Tensor failed = world.all_gather(at::full({1}, failure ? 1.0 : 0.0, at::kDouble));
  if (failure) std::rethrow_exception(failure);
  std::string ranks;
  for (int r = 0; r < world.size(); ++r)
    if (failed[r].item<double>() != 0.0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  HP_CHECK(ranks.empty(), "memory.budget_mb: planning failed on rank ", ranks, " (its error is on its output)");
  return result;
}

// What each of `modes` (modes[0] is "full") adds to a step per block and micro-batch, from a step
// (after one that warms up) of `c`'s layout on `world` with each of `steps`' blocks. Every rank
// returns the same costs: the sums over the ranks' blocks, as rank 0 has them. A rank's last
// swapped block, whose outputs may stay (when it ends its stage), may time swap without its copies:
// it counts only where no other swapped block was timed.
std::vector<double> profile(const TrainConfig& c, const comm::ProcessGroup& world,
                            const std::vector<std::string>& modes, const std::vector<std::vector<std::string>>& steps) {
  const int64_t layers = c.model->layers(), count = static_cast<int64_t>(modes.size());
  // By mode, then the last swapped blocks: forward seconds, recomputation seconds, blocks timed
  // (this rank's).
  at::Tensor sums = at::zeros({count + 1, 3}, at::kDouble);
  const auto add = [&](int64_t row, const CheckpointStats& stats) {
    at::Tensor r = sums[row];
    r[0] += stats.forward_seconds;
    r[1] += stats.recompute_seconds;
    r[2] += 1.0;
  };
  for (const std::vector<std::string>& blocks : steps) {
    LayoutStep step(with_blocks(c, blocks), world);
    step.run(c.per_rank_batch());  // first allocations, kernels' first calls
    step.run(c.per_rank_batch());
    const auto& checkpointed = step.parts().checkpointed;  // every block, in layer order
    HP_CHECK(static_cast<int64_t>(checkpointed.size()) == layers, "memory.budget_mb: the profiled step checkpointed ",
             checkpointed.size(), " of ", layers, " blocks");
    const CheckpointStats* last_swapped = nullptr;
    for (int64_t i = 0; i < layers; ++i) {
      const CheckpointStats& stats = checkpointed[i].second.stats();
      if (stats.forward_seconds == 0.0) continue;  // another pipeline stage's block
      const int64_t m = std::find(modes.begin(), modes.end(), blocks[i]) - modes.begin();
      if (blocks[i] != "swap") {
        add(m, stats);
        continue;
      }
      if (last_swapped != nullptr) add(m, *last_swapped);
      last_swapped = &stats;
    }
    if (last_swapped != nullptr) add(count, *last_swapped);
  }
  // Rank 0's sums for all: a reduction need not give every rank the same bits, and every rank must
  // choose the same plan.
  sums = world.broadcast(world.all_reduce(sums), 0);
  const auto timed = [&](int64_t m) { return sums[m][2].item<double>() > 0.0; };
  const auto mean = [&](int64_t m, int64_t column) {
    return sums[m][column].item<double>() / sums[m][2].item<double>();
  };
  std::vector<double> costs;
  for (int64_t m = 0; m < count; ++m) {
    const int64_t row = timed(m) || modes[m] != "swap" ? m : count;
    HP_CHECK(timed(row), "memory.budget_mb: the profiled steps timed no block in ", modes[m]);
    costs.push_back(std::max(0.0, mean(row, 0) + mean(row, 1) - mean(0, 0)));
  }
  return costs;
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& c, const comm::ProcessGroup& world) {
  HP_CHECK(c.memory.budget_mb > 0, "plan_memory: memory.budget_mb is not set");
  const int64_t layers = c.model->layers();
  const double budget = static_cast<double>(c.memory.budget_mb) * (1 << 20), target = budget / kMargin;
  const std::vector<int64_t> stages = stage_layers(c);
  const int64_t largest_stage = *std::max_element(stages.begin(), stages.end());
  const std::vector<PipelinePosition> positions = positions_of(c, stages);
  std::vector<std::string> modes = {"full", "selective"};
  if (c.memory.swap != "none") modes.push_back("swap");
  std::ostringstream report;
  report << "memory.budget_mb " << c.memory.budget_mb << ": plans keep the dry run's step peak under " << mib(target)
         << " (the budget less a " << std::setprecision(2) << (kMargin - 1) * 100 << "% margin)\n";

  // Dry runs, each rank its own (the same ones), each giving every pipeline position's peak:
  // without checkpointing; full checkpointing of every block (the least any plan keeps); each mode
  // in every block but each stage's last; the blocks to profile.
  struct Peaks {
    std::vector<int64_t> none, full;
    std::vector<std::vector<int64_t>> all_but_last;  // by mode
    std::vector<std::vector<std::string>> profiled;
    int64_t profiled_peak = 0;
  };
  const auto every_stage = [&](const std::vector<int64_t>& counts) {
    return std::vector<std::vector<int64_t>>(stages.size(), counts);
  };
  const auto all_but_last = [&](const std::string& mode) {
    return assign(stages, {mode}, every_stage({largest_stage}));
  };
  const Peaks peaks = agreed(world, [&] {
    Peaks p;
    p.none = predicted_peaks(c, world.size(), std::vector<std::string>(layers, "none"));
    if (static_cast<double>(largest(p.none)) <= target) return p;
    p.full = predicted_peaks(c, world.size(), std::vector<std::string>(layers, "full"));
    if (static_cast<double>(largest(p.full)) > target) return p;
    for (const std::string& mode : modes)
      p.all_but_last.push_back(predicted_peaks(c, world.size(), all_but_last(mode)));
    const auto peak_of = [&](const std::vector<std::vector<std::string>>& steps) {
      int64_t peak = 0;
      for (const auto& blocks : steps) peak = std::max(peak, largest(predicted_peaks(c, world.size(), blocks)));
      return peak;
    };
    p.profiled = round_robin(layers, modes);
    p.profiled_peak = peak_of(p.profiled);
    int64_t timing_blocks = 0;
    for (size_t m = 1; m < modes.size(); ++m) timing_blocks += blocks_to_time(modes[m]);
    if (static_cast<double>(p.profiled_peak) > target && layers > timing_blocks) {
      std::vector<std::vector<std::string>> fewest = {fewest_blocks(stages, modes)};
      const int64_t fewest_peak = peak_of(fewest);
      if (fewest_peak < p.profiled_peak) {
        p.profiled = std::move(fewest);
        p.profiled_peak = fewest_peak;
      }
    }
    return p;
  });
  MemoryPlan plan;
  report << "  without checkpointing: " << mib(static_cast<double>(largest(peaks.none)));
  if (static_cast<double>(largest(peaks.none)) <= target) {
    plan.blocks.assign(layers, "none");
    plan.peak_bytes = largest(peaks.none);
    plan.report = report.str() + ", which fits: no block is checkpointed";
    return plan;
  }
  report << "; full checkpointing of every block: " << mib(static_cast<double>(largest(peaks.full))) << "\n";
  HP_CHECK(static_cast<double>(largest(peaks.full)) <= target, "memory.budget_mb ", c.memory.budget_mb,
           " is below what any plan needs: full checkpointing of every block peaks at ",
           mib(static_cast<double>(largest(peaks.full))), " (dry run), ", mib(target),
           " at most with the margin; raise the budget, shard more (parallel.*), or offload (memory.offload)");
  if (static_cast<double>(peaks.profiled_peak) > target)
    report << "  the profiled step peaks at " << mib(static_cast<double>(peaks.profiled_peak))
           << " (dry run), over that: timing a mode needs a block in it\n";
  const std::vector<double> measured = profile(c, world, modes, peaks.profiled);

  // The modes, those that keep the least first.
  std::vector<size_t> order(modes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return largest(peaks.all_but_last[a]) < largest(peaks.all_but_last[b]); });
  std::vector<std::string> sorted_modes;
  std::vector<double> costs;
  report << "  every block but each stage's last (dry run; measured cost per block and micro-batch):";
  for (size_t m : order) {
    sorted_modes.push_back(modes[m]);
    costs.push_back(measured[m]);
    report << " " << modes[m] << " " << mib(static_cast<double>(largest(peaks.all_but_last[m]))) << " +"
           << ms(measured[m]) << ";";
  }
  report << "\n";
  // Each pipeline position's candidates, cheapest first: its stages' peak depends on their blocks.
  std::vector<std::vector<BlockSplit>> choices;
  for (size_t p = 0; p < positions.size(); ++p) {
    const int64_t per_stage = positions[p].largest - 1;  // blocks a stage may checkpoint
    std::vector<double> saving;                          // by sorted mode: per block it keeps less in
    for (size_t m : order)
      saving.push_back(per_stage > 0 ? static_cast<double>(peaks.none[p] - peaks.all_but_last[m][p]) /
                                           static_cast<double>(per_stage)
                                     : 0.0);
    choices.push_back(candidates(per_stage, static_cast<double>(peaks.none[p]), saving, costs, target));
  }

  const auto chosen = [&](std::vector<std::string> blocks, int64_t peak) {
    plan.blocks = std::move(blocks);
    plan.peak_bytes = peak;
    for (const std::string& block : plan.blocks)
      for (size_t m = 0; m < sorted_modes.size(); ++m)
        if (block == sorted_modes[m]) plan.seconds_per_micro_batch += costs[m];
    report << "  plan: memory.blocks " << listed(plan.blocks) << ": peak " << mib(static_cast<double>(peak))
           << " (dry run), recomputation and copies about " << ms(plan.seconds_per_micro_batch) << " per micro-batch"
           << (stages.size() > 1 ? " (its stages together)" : "");
    plan.report = report.str();
    return plan;
  };
  // Dry runs again (each rank its own), agreed as before: every position starts at its cheapest
  // candidate, and those over the limit move on to their next, until all fit.
  plan = agreed(world, [&] {
    const size_t full =
        static_cast<size_t>(std::find(sorted_modes.begin(), sorted_modes.end(), "full") - sorted_modes.begin());
    std::vector<int64_t> full_but_last(sorted_modes.size(), 0);
    full_but_last[full] = largest_stage;
    // Each position's current candidate; past its list: full checkpointing of all but the last.
    std::vector<size_t> next(positions.size(), 0);
    const auto blocks_now = [&] {
      std::vector<std::vector<int64_t>> counts(stages.size());
      for (size_t p = 0; p < positions.size(); ++p)
        for (size_t s : positions[p].stages)
          counts[s] = next[p] < choices[p].size() ? choices[p][next[p]].counts : full_but_last;
      return assign(stages, sorted_modes, counts);
    };
    for (int tried = 0; tried < kDryRunsOfCandidates; ++tried) {
      std::vector<std::string> blocks = blocks_now();
      const std::vector<int64_t> at = predicted_peaks(c, world.size(), blocks);
      if (static_cast<double>(largest(at)) <= target) return chosen(std::move(blocks), largest(at));
      report << "  tried " << listed(blocks) << ": peak " << mib(static_cast<double>(largest(at)))
             << " (dry run), over\n";
      bool moved = false;
      for (size_t p = 0; p < positions.size(); ++p)
        if (static_cast<double>(at[p]) > target && next[p] < choices[p].size()) {
          ++next[p];
          moved = true;
        }
      if (!moved) break;  // the positions over are at full checkpointing of all but the last block
    }
    // Full checkpointing of every block but each stage's last, or of every block.
    if (static_cast<double>(largest(peaks.all_but_last[0])) <= target)  // modes[0] is full
      return chosen(all_but_last("full"), largest(peaks.all_but_last[0]));
    return chosen(std::vector<std::string>(layers, "full"), largest(peaks.full));
  });
  // Every rank must checkpoint the same blocks: a recomputation runs the collectives inside a block
  // again. The dry runs are deterministic; this says so if that ever stops being true.
  const int64_t mine = static_cast<int64_t>(std::hash<std::string>{}(listed(plan.blocks)));
  const at::Tensor all = world.all_gather(at::tensor({mine}, at::kLong));
  for (int r = 0; r < world.size(); ++r)
    HP_CHECK(all[r].item<int64_t>() == all[0].item<int64_t>(), "memory.budget_mb: rank ", r,
             " chose other blocks than rank 0 (its dry runs differ); set memory.blocks instead");
  return plan;
}

TrainConfig with_memory_plan(const TrainConfig& c, const comm::ProcessGroup& world) {
  const MemoryPlan plan = plan_memory(c, world);
  if (world.rank() == 0) log::info(plan.report);
  return with_blocks(c, plan.blocks);
}

}  // namespace hp::train::detail
