// hp-plan's search: which layouts of a job fit in memory, and which is fastest.
//
//   const auto ranked = hp::train::plan_layouts(config, calibration, {.world_size = 8, ...});
//   ranked.front().overrides;  // the hp-train overrides of the fastest layout that fits
//
// Every candidate (dp_replicate x dp_shard x tp x pp x cp x ep over the world size, pipeline
// schedule, micro-batch, activation checkpointing; sequence parallelism wherever tp > 1) that the
// config accepts is dry-run (hp/train/dry_run.h: one rank, or every position of one pipeline), its
// peak checked against the memory limit, and its step time estimated from the calibration
// (hp/train/cost_model.h). Ranks are taken as symmetric within a layout: rank 0's pipeline stands
// for all (a skewed routing model's hot expert rank is not searched for).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hp/train/config.h"
#include "hp/train/cost_model.h"
#include "hp/train/dry_run.h"

namespace hp::train {

struct PlanOptions {
  int world_size = 1;
  int64_t memory_limit_bytes = 0;  // 0: no limit
  double allocator_slack = 0.1;    // as DryRunReport::fits
  // What is searched besides the parallel dims: the schedules of pp > 1, checkpointing, and the
  // micro-batch (the largest `micro_batch_choices` divisors of each layout's per-rank batch). A
  // schedule is not tried where an earlier one of the same stage count holds no more activations
  // and idles no more at equal costs (V-Half and V-Min hold what ZBV holds at pp 2, and idle more).
  std::vector<std::string> schedules = {"1f1b", "zbv", "vhalf", "vmin"};
  std::vector<std::string> checkpointing = {"none", "full"};
  int micro_batch_choices = 3;
  DryRunOptions dry_run;
  std::function<void(const std::string&)> progress;  // a line per layout tried
};

struct PlannedLayout {
  std::vector<std::string> overrides;  // hp-train's "key=value" overrides of this layout
  TrainConfig config;
  int64_t peak_bytes = 0;  // the largest of its pipeline positions'
  bool fits = true;
  StepTimeEstimate estimate;
  std::string describe() const;  // "dp_shard 2 x tp 2, sp, micro_batch 4, checkpoint full"
};

// The candidates' overrides for `config` on `world_size` ranks, in search order (not yet validated).
std::vector<std::vector<std::string>> candidate_layouts(const TrainConfig& config, const PlanOptions& options);

// The candidates the config accepts, fitting ones first by predicted step time (equal times: by
// peak), then the others by peak.
std::vector<PlannedLayout> plan_layouts(const TrainConfig& config, const Calibration& calibration,
                                        const PlanOptions& options);
// The same by memory alone: no estimates, fitting ones first, each group by peak.
std::vector<PlannedLayout> plan_layouts(const TrainConfig& config, const PlanOptions& options);

}  // namespace hp::train
