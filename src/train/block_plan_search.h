// The search behind memory.budget_mb (train/memory_budget.h), without ranks or dry runs: which
// pipeline position runs each stage, how a stage's blocks split among the modes, which splits to
// dry-run first, and which blocks the profiled steps time each mode in. Modes are memory.blocks'
// names ("none", "full", "selective", "swap").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/train/config.h"

namespace hp::train::detail {

// The layers of each pipeline stage, in stage order (one stage without pipeline parallelism).
std::vector<int64_t> stage_layers(const TrainConfig& c);

// A pipeline position of world rank 0's pipeline (dry_run_pipeline's order) and its stages.
struct PipelinePosition {
  std::vector<size_t> stages;
  int64_t largest = 0;  // layers of its largest stage
};
std::vector<PipelinePosition> positions_of(const TrainConfig& c, const std::vector<int64_t>& stages);

// Within stage s, counts[s][m] blocks of modes[m] in that order from its first block, the rest
// none, its last block always: backward starts there, so checkpointing it saves nothing (its
// recomputation rebuilds what it kept at once), and a swapped last block never leaves.
std::vector<std::string> assign(const std::vector<int64_t>& stages, const std::vector<std::string>& modes,
                                const std::vector<std::vector<int64_t>>& counts);

// A split of a stage's blocks among the modes.
struct BlockSplit {
  std::vector<int64_t> counts;  // blocks of each mode
  double seconds = 0.0;         // what they add per micro-batch
  double estimated_peak = 0.0;  // none's peak, less the modes' savings
};
// Every split of up to `blocks` blocks among the modes whose savings per block and costs are given
// whose estimated peak is at most `target`, cheapest first (equal costs: fewest blocks changed,
// then lower peak). Each block saves its mode's saving, a swapped one too: never a stage's last,
// it has a block after it, whose forward's end sends its outputs away.
std::vector<BlockSplit> candidates(int64_t blocks, double none_peak, const std::vector<double>& saving_per_block,
                                   const std::vector<double>& costs, double target);

// The blocks of the profiled steps: in each, block i in modes[(i + step's rotation) mod M], so that
// every mode is timed on real blocks (rotated where there are fewer blocks than modes).
std::vector<std::vector<std::string>> round_robin(int64_t layers, const std::vector<std::string>& modes);

// The blocks that time `mode` with its copies: a swapped block's outputs leave when the next
// block's forward ends, and the timed blocks may end a stage, so swap takes two in a row (the first
// timed with its copies).
int64_t blocks_to_time(const std::string& mode);

// The fewest blocks that time each mode: the first blocks of the last pipeline stage (which holds
// the fewest micro-batches) in the modes after the first (swap in two blocks in a row), every
// other block in the first mode. An error where there are not more blocks than those.
std::vector<std::string> fewest_blocks(const std::vector<int64_t>& stages, const std::vector<std::string>& modes);

}  // namespace hp::train::detail
