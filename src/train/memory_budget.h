// memory.budget_mb, the automatic memory strategy: what each block keeps for backward (none, full,
// selective, or swap where memory.swap names a tier) so that a step fits a per-rank memory budget at
// the least cost in time (docs/memory.md#block-by-block-and-the-automatic-strategy).
//
// Memory comes from dry runs (hp/train/dry_run.h): the step's peak without checkpointing, with every
// block fully checkpointed, with each mode in every block but each stage's last, then the
// candidates' own. Time comes from a profiled step of the real layout (one to three, each after a
// warm-up step), on the job's ranks, with every block checkpointed in one of the modes: a mode's cost per block is its
// recomputation (and reload waits) plus what its forward takes beyond a fully checkpointed one's (saving, queueing
// copies). Each pipeline position chooses for its stages: the modes that keep the least first and
// blocks without checkpointing last, a stage's last block always (backward starts there:
// checkpointing it saves nothing).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/train/config.h"

namespace hp::train::detail {

struct MemoryPlan {
  std::vector<std::string> blocks;  // memory.blocks: one mode per layer
  int64_t peak_bytes = 0;           // its dry run's step peak (the largest pipeline position's)
  // What its recomputation and copies add per micro-batch, from the profiled step (0 without it).
  double seconds_per_micro_batch = 0.0;
  std::string report;  // what was measured and chosen, for the log
};

// The plan for `c` (memory.budget_mb > 0): plans keep the predicted peak a margin under the budget,
// as a measured peak can exceed the dry run's by a few percent (docs/planning.md). Collective over
// `world`, the run's ranks (the profiled step runs on them); every rank returns the same plan. An
// error says so when no plan fits (with the least peak any reaches).
MemoryPlan plan_memory(const TrainConfig& c, const comm::ProcessGroup& world);

// `c` with its plan's memory.blocks in place of memory.budget_mb, the plan logged by world rank 0.
// Collective over `world`, as plan_memory is.
TrainConfig with_memory_plan(const TrainConfig& c, const comm::ProcessGroup& world);

}  // namespace hp::train::detail
