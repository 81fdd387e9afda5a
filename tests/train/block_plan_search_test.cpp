// The search behind memory.budget_mb (train/block_plan_search.h), without ranks or dry runs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.h"
#include "train/block_plan_search.h"

namespace hp::train::detail {
namespace {

using Blocks = std::vector<std::string>;

TrainConfig pipeline_config(const std::string& parallel) {
  return parse_config(
      "model: {dim: 64, layers: 8, heads: 4, kv_heads: 2, ffn_hidden: 128, max_seq: 32}\n"
      "data: {seq_len: 32}\ntrain: {steps: 2, global_batch: 8, micro_batch: 2}\nparallel: " +
          parallel,
      {});
}

// Stages split the layers as the recipe does; an interleaved schedule's stages alternate between
// the positions.
TEST(BlockPlanSearch, StagesAndTheirPositions) {
  EXPECT_EQ(stage_layers(pipeline_config("{pp: 1}")), (std::vector<int64_t>{8}));
  // A leftover pp_layers_per_stage without a pipeline is not a split.
  EXPECT_EQ(stage_layers(pipeline_config("{pp: 1, pp_layers_per_stage: [3, 5]}")), (std::vector<int64_t>{8}));
  EXPECT_EQ(stage_layers(pipeline_config("{pp: 2, pp_layers_per_stage: [3, 5]}")), (std::vector<int64_t>{3, 5}));
  const TrainConfig interleaved = pipeline_config("{pp: 2, pp_schedule: interleaved, pp_stages_per_rank: 2}");
  const std::vector<int64_t> stages = stage_layers(interleaved);
  EXPECT_EQ(stages, (std::vector<int64_t>{2, 2, 2, 2}));
  const std::vector<PipelinePosition> positions = positions_of(interleaved, stages);
  ASSERT_EQ(positions.size(), 2u);
  EXPECT_EQ(positions[0].stages, (std::vector<size_t>{0, 2}));
  EXPECT_EQ(positions[1].stages, (std::vector<size_t>{1, 3}));
  EXPECT_EQ(positions[0].largest, 2);
}

// Modes fill a stage from its first block, in order; the stage's last block is never checkpointed,
// however many the counts ask for.
TEST(BlockPlanSearch, AssignLeavesEachStagesLastBlockUnchecked) {
  EXPECT_EQ(assign({3, 2}, {"full", "selective"}, {{1, 1}, {2, 0}}),
            (Blocks{"full", "selective", "none", "full", "none"}));
  EXPECT_EQ(assign({1}, {"full"}, {{5}}), (Blocks{"none"}));
  EXPECT_EQ(assign({4}, {"full", "swap"}, {{0, 2}}), (Blocks{"swap", "swap", "none", "none"}));
}

// Candidates are the splits whose estimate fits, cheapest first; every block saves its mode's
// saving, a swapped one too.
TEST(BlockPlanSearch, CandidatesFitByEstimateCheapestFirst) {
  // 2 blocks; full saves 10 and costs 3, selective saves 4 and costs 1; none peaks at 100.
  const std::vector<BlockSplit> splits = candidates(2, 100.0, {10.0, 4.0}, {3.0, 1.0}, 92.0);
  std::vector<std::vector<int64_t>> counts;
  for (const BlockSplit& s : splits) counts.push_back(s.counts);
  EXPECT_EQ(counts, (std::vector<std::vector<int64_t>>{{0, 2}, {1, 0}, {1, 1}, {2, 0}}));
  EXPECT_EQ(splits.front().seconds, 2.0);
  EXPECT_EQ(splits.front().estimated_peak, 92.0);
  const std::vector<BlockSplit> swapped = candidates(3, 100.0, {5.0}, {1.0}, 95.0);
  ASSERT_EQ(swapped.size(), 3u);
  EXPECT_EQ(swapped[0].counts, (std::vector<int64_t>{1}));
  EXPECT_EQ(swapped[0].estimated_peak, 95.0);
  EXPECT_TRUE(candidates(2, 100.0, {1.0}, {1.0}, 50.0).empty());
  // A mode measured at no cost (noise clamped to 0) changes no block it need not: fewest first.
  std::vector<std::vector<int64_t>> free_counts;
  for (const BlockSplit& s : candidates(2, 100.0, {4.0}, {0.0}, 100.0)) free_counts.push_back(s.counts);
  EXPECT_EQ(free_counts, (std::vector<std::vector<int64_t>>{{0}, {1}, {2}}));
}

// The profiled steps time every mode on real blocks: round robin, rotated where there are fewer
// blocks than modes; narrowed, the modes after the first sit at the last stage's first blocks,
// swap in two blocks in a row.
TEST(BlockPlanSearch, TheProfiledBlocksTimeEveryMode) {
  EXPECT_EQ(round_robin(4, {"full", "selective", "swap"}),
            (std::vector<Blocks>{{"full", "selective", "swap", "full"}}));
  EXPECT_EQ(round_robin(2, {"full", "selective", "swap"}),
            (std::vector<Blocks>{{"full", "selective"}, {"swap", "full"}}));
  EXPECT_EQ(fewest_blocks({4, 4}, {"full", "selective", "swap"}),
            (Blocks{"full", "full", "full", "full", "selective", "swap", "swap", "full"}));
  EXPECT_EQ(fewest_blocks({4}, {"full", "selective"}), (Blocks{"selective", "full", "full", "full"}));
  test::expect_error(
      [] {
        fewest_blocks({3}, {"full", "selective", "swap"});
      },
      "memory.budget_mb: 3 blocks cannot time 3 modes");
}

}  // namespace
}  // namespace hp::train::detail
