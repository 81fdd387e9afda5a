// hp-plan's search over layouts (hp/train/auto_parallel.h).
#include "hp/train/auto_parallel.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "hp/core/error.h"
#include "hp/pp/schedule.h"

namespace hp::train {
namespace {

// Every way to write `n` as an ordered product of `parts` factors.
void factorizations(int64_t n, int parts, std::vector<int64_t>& prefix, std::vector<std::vector<int64_t>>& out) {
  if (parts == 1) {
    prefix.push_back(n);
    out.push_back(prefix);
    prefix.pop_back();
    return;
  }
  for (int64_t f = 1; f <= n; ++f) {
    if (n % f != 0) continue;
    prefix.push_back(f);
    factorizations(n / f, parts - 1, prefix, out);
    prefix.pop_back();
  }
}

// `schedules` less those that an earlier one placing the stages alike (as many, in a V or not: the
// same layers on the same ranks, so the config allows both or neither) matches or beats at equal
// costs, on `ranks` ranks with `micro_batches`: it holds no more activations and idles no more.
// A schedule that cannot be built here is left to the config's validation to refuse.
std::set<std::string> worth_trying(const std::vector<std::string>& schedules, int ranks, int micro_batches,
                                   int stages_per_rank) {
  struct Tried {
    int stages;
    bool v_shape;
    double memory, bubble;
  };
  std::vector<Tried> kept;
  std::set<std::string> out;
  for (const std::string& name : schedules) {
    std::optional<pp::Schedule> s;
    try {
      s = pp::schedule_by_name(name, ranks, micro_batches, stages_per_rank);
    } catch (const Error&) {
      out.insert(name);
      continue;
    }
    const Tried t{s->stages, pp::places_in_a_v(name), pp::peak_memory_in_1f1b_stages(*s), pp::simulate(*s).bubble};
    const bool beaten = std::any_of(kept.begin(), kept.end(), [&](const Tried& k) {
      return k.stages == t.stages && k.v_shape == t.v_shape && k.memory <= t.memory && k.bubble <= t.bubble + 1e-12;
    });
    if (beaten) continue;
    kept.push_back(t);
    out.insert(name);
  }
  return out;
}

}  // namespace

std::string PlannedLayout::describe() const {
  std::ostringstream out;
  out << config.parallel.str();
  if (config.sequence_parallel) out << ", sp";
  if (config.parallel.pp > 1) out << ", " << config.pp_schedule;
  out << ", micro_batch " << config.train.micro_batch;
  if (config.memory.checkpoint != "none") out << ", checkpoint " << config.memory.checkpoint;
  return out.str();
}

namespace {

// `overrides` of a layout with dims d (dp_replicate, dp_shard, tp, pp, cp), plus what keeps the
// config's settings of reductions the layout does not have from refusing it: a data-parallel
// gradient dtype or wire without data parallelism, a tensor-parallel wire without tensor
// parallelism (validate refuses each, rather than ignore it).
std::vector<std::string> with_reductions_of(const TrainConfig& c, const std::vector<int64_t>& d,
                                            std::vector<std::string> overrides) {
  if (d[0] * d[1] * d[4] == 1) {
    if (c.train.mixed_precision_reduce != "fp32") overrides.push_back("train.mixed_precision_reduce=fp32");
    if (c.comm_settings.gradient_wire != "native") overrides.push_back("comm.gradient_wire=native");
  }
  if (d[2] == 1 && c.comm_settings.tp_wire != "native") overrides.push_back("comm.tp_wire=native");
  return overrides;
}

}  // namespace

std::vector<std::vector<std::string>> candidate_layouts(const TrainConfig& c, const PlanOptions& o) {
  HP_CHECK(o.world_size >= 1, "hp-plan: the world size must be >= 1, got ", o.world_size);
  HP_CHECK(o.micro_batch_choices >= 1, "hp-plan: micro_batch_choices must be >= 1");
  HP_CHECK(c.memory.budget_mb == 0 && c.memory.blocks.empty(), "hp-plan: it searches memory.checkpoint itself; ",
           "leave memory.blocks and memory.budget_mb (hp-train's choice per block) unset");
  std::vector<std::vector<int64_t>> dims;
  std::vector<int64_t> prefix;
  factorizations(o.world_size, 5, prefix, dims);  // dp_replicate, dp_shard, tp, pp, cp
  std::vector<std::vector<std::string>> out;
  std::map<std::pair<int64_t, int64_t>, std::set<std::string>> pruned;  // by (pp, micro-batches)
  for (const auto& d : dims) {
    const int64_t dp = d[0] * d[1], pp = d[3];
    if (c.train.global_batch % dp != 0) continue;
    const int64_t per_rank = c.train.global_batch / dp;
    std::vector<int64_t> micro;
    for (int64_t m = per_rank; m >= 1 && static_cast<int>(micro.size()) < o.micro_batch_choices; --m)
      if (per_rank % m == 0) micro.push_back(m);
    // Expert parallelism over the ranks that shard each layer's tokens (1 for a dense model:
    // a config whose model has no experts refuses ep > 1).
    std::vector<int64_t> eps;
    for (int64_t ep = 1; ep <= d[1] * d[2] * d[4]; ++ep)
      if ((d[1] * d[2] * d[4]) % ep == 0) eps.push_back(ep);
    const std::vector<std::string> schedules = pp > 1 ? o.schedules : std::vector<std::string>{c.pp_schedule};
    if (pp > 1)
      for (int64_t m : micro)
        if (!pruned.count({pp, per_rank / m}))
          pruned[{pp, per_rank / m}] = worth_trying(o.schedules, static_cast<int>(pp), static_cast<int>(per_rank / m),
                                                    static_cast<int>(c.pp_stages_per_rank));
    for (int64_t ep : eps)
      for (const std::string& schedule : schedules)
        for (int64_t m : micro)
          for (const std::string& checkpoint : o.checkpointing)
            if (pp == 1 || pruned.at({pp, per_rank / m}).count(schedule))
              out.push_back(with_reductions_of(
                  c, d,
                  {"parallel.dp_replicate=" + std::to_string(d[0]), "parallel.dp_shard=" + std::to_string(d[1]),
                   "parallel.tp=" + std::to_string(d[2]), "parallel.pp=" + std::to_string(pp),
                   "parallel.cp=" + std::to_string(d[4]), "parallel.ep=" + std::to_string(ep),
                   std::string("parallel.sequence_parallel=") + (d[2] > 1 ? "true" : "false"),
                   "parallel.pp_schedule=" + schedule, "train.micro_batch=" + std::to_string(m),
                   "memory.checkpoint=" + checkpoint}));
  }
  return out;
}

namespace {

// Without a calibration (nullptr): by memory alone.
std::vector<PlannedLayout> plan(const TrainConfig& c, const Calibration* cal, const PlanOptions& o) {
  const std::string base = to_json(c);
  std::vector<PlannedLayout> planned;
  for (const std::vector<std::string>& overrides : candidate_layouts(c, o)) {
    PlannedLayout layout;
    layout.overrides = overrides;
    try {
      layout.config = parse_config(base, overrides, "hp-plan");
      validate(layout.config, o.world_size);
    } catch (const Error&) {
      continue;  // a layout the config does not allow (divisibility, a dense model's ep)
    }
    std::vector<DryRunReport> positions;
    try {
      positions = dry_run_pipeline(layout.config, o.world_size, 0, o.dry_run);
    } catch (const Error& e) {
      if (o.progress) o.progress(layout.describe() + ": the dry run failed: " + e.what());
      continue;
    }
    std::vector<StepWork> work;
    for (const DryRunReport& r : positions) {
      layout.peak_bytes = std::max(layout.peak_bytes, r.peak_bytes);
      layout.fits = layout.fits && (o.memory_limit_bytes <= 0 || r.fits(o.memory_limit_bytes, o.allocator_slack));
      work.push_back(r.work);
    }
    if (cal != nullptr) layout.estimate = estimate_step_time(layout.config, work, *cal);
    if (o.progress)
      o.progress(layout.describe() + ": " +
                 (cal != nullptr ? layout.estimate.str() : "peak " + std::to_string(layout.peak_bytes) + " B"));
    planned.push_back(std::move(layout));
  }
  std::stable_sort(planned.begin(), planned.end(), [](const PlannedLayout& a, const PlannedLayout& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits && a.estimate.seconds != b.estimate.seconds) return a.estimate.seconds < b.estimate.seconds;
    return a.peak_bytes < b.peak_bytes;
  });
  return planned;
}

}  // namespace

std::vector<PlannedLayout> plan_layouts(const TrainConfig& config, const Calibration& calibration,
                                        const PlanOptions& options) {
  return plan(config, &calibration, options);
}

std::vector<PlannedLayout> plan_layouts(const TrainConfig& config, const PlanOptions& options) {
  return plan(config, nullptr, options);
}

}  // namespace hp::train
