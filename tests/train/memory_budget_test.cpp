// memory.blocks (what each block keeps for backward) and memory.budget_mb (the automatic strategy
// that chooses them, train/memory_budget.h): a run whose plain peak is over the budget trains under
// it with the same losses, bit for bit; mixed blocks change no bit; a budget that nothing meets, or
// that plain training meets, is said so.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "hp/models/llama/spec.h"
#include "hp/testing/run_ranks.h"
#include "hp/train/dry_run.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/later_step_peak.h"
#include "train/memory_budget.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

// A Llama whose activations are most of a step's memory: 4 blocks, 8 sequences of 128 tokens a rank.
TrainConfig budget_config(const std::string& dir) {
  TrainConfig c = small_llama_config(dir);
  c.model.as<models::LlamaConfig>() = models::LlamaConfig{256, 64, 4, 4, 2, 128, 128};
  c.data.seq_len = 128;
  c.seed = 5;
  c.train.steps = 3;
  c.train.global_batch = 16;
  c.train.micro_batch = 8;
  c.eval.interval = 0;
  c.parallel.dp_shard = 2;
  return c;
}

// Each rank's losses and largest peak of the steps after the first.
struct RunRecord {
  std::vector<double> losses;
  std::vector<double> peaks;  // by rank
};

RunRecord run(const TrainConfig& c) {
  const auto watched = train_watching_peaks(c, static_cast<int>(c.parallel.world_size()));
  RunRecord out{watched[0]->losses, {}};
  for (const auto& w : watched) out.peaks.push_back(w->bytes);
  return out;
}

// The test: a budget that plain training exceeds is met, measured, with bitwise-equal losses.
TEST(MemoryBudget, MeetsABudgetThatPlainTrainingExceeds) {
  const std::string dir = test::scratch_dir("memory_budget_meets");
  TrainConfig c = budget_config(dir);
  const RunRecord plain = run(c);
  ASSERT_EQ(plain.losses.size(), 3u);
  const double plain_peak = *std::max_element(plain.peaks.begin(), plain.peaks.end());
  // 85% of plain training's peak: more than full checkpointing of every block needs (about 70%
  // here), so the strategy has a choice to make.
  c.memory.budget_mb = static_cast<int64_t>(0.85 * plain_peak / (1 << 20));
  const double budget = static_cast<double>(c.memory.budget_mb) * (1 << 20);
  ASSERT_LT(budget, plain_peak);
  std::cout << "plain peak " << plain_peak / (1 << 20) << " MiB, budget " << c.memory.budget_mb << " MiB\n";
  const RunRecord planned = run(c);
  EXPECT_EQ(planned.losses, plain.losses);
  for (size_t rank = 0; rank < planned.peaks.size(); ++rank) {
    std::cout << "rank " << rank << ": measured peak " << planned.peaks[rank] / (1 << 20) << " MiB\n";
    EXPECT_LT(planned.peaks[rank], budget) << "rank " << rank;
  }
}

// Blocks in every mode at once (two share a swap tier) give the losses of none, bit for bit, and
// keep less.
TEST(MemoryBudget, MixedBlocksChangeNoLoss) {
  const std::string dir = test::scratch_dir("memory_blocks_mixed");
  TrainConfig c = budget_config(dir);
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.model.as<models::LlamaConfig>().layers = 5;
  const RunRecord plain = run(c);
  ASSERT_EQ(plain.losses.size(), 3u);
  c.memory.swap = "host";
  c.memory.blocks = {"swap", "full", "swap", "selective", "none"};
  const RunRecord mixed = run(c);
  EXPECT_EQ(mixed.losses, plain.losses);
  for (size_t rank = 0; rank < mixed.peaks.size(); ++rank) {
    std::cout << "rank " << rank << ": peak " << plain.peaks[rank] / (1 << 20) << " MiB plain, "
              << mixed.peaks[rank] / (1 << 20) << " MiB mixed\n";
    EXPECT_LT(mixed.peaks[rank], 0.9 * plain.peaks[rank]) << "rank " << rank;
  }
}

// Through a pipeline with swap: every rank takes the same plan, each stage's last block is never
// checkpointed, and the plan's dry-run peak is under the budget less the margin.
TEST(MemoryBudget, PlansEveryPipelineStage) {
  const std::string dir = test::scratch_dir("memory_budget_pipeline");
  TrainConfig c = budget_config(dir);
  c.parallel.dp_shard = 1;
  c.parallel.pp = 2;
  c.memory.swap = "host";
  c.model.as<models::LlamaConfig>().layers = 6;
  const auto peaks = [&](const std::string& mode) {
    TrainConfig every = c;
    every.memory.blocks.assign(6, mode);
    std::vector<double> out;
    for (const DryRunReport& report : dry_run_pipeline(every, 2, 0))
      out.push_back(static_cast<double>(report.peak_bytes));
    return out;
  };
  const std::vector<double> none_at = peaks("none"), full_at = peaks("full");
  const double none = *std::max_element(none_at.begin(), none_at.end()),
               full = *std::max_element(full_at.begin(), full_at.end());
  // Halfway between, with the margin: something must be checkpointed, and full everywhere fits.
  c.memory.budget_mb = static_cast<int64_t>(1.05 * (none + full) / 2 / (1 << 20));
  ASSERT_GT(static_cast<double>(c.memory.budget_mb) * (1 << 20), 1.05 * full);
  ASSERT_LT(static_cast<double>(c.memory.budget_mb) * (1 << 20), 1.05 * none);
  std::vector<detail::MemoryPlan> plans(2);
  testing::run_ranks(
      2, [&](const comm::ProcessGroup& world) { plans[world.rank()] = detail::plan_memory(c, world); }, ranks_for(c));
  std::cout << plans[0].report << "\n";
  EXPECT_EQ(plans[0].blocks, plans[1].blocks);
  ASSERT_EQ(plans[0].blocks.size(), 6u);
  EXPECT_EQ(plans[0].blocks[2], "none");
  EXPECT_EQ(plans[0].blocks[5], "none");
  EXPECT_NE(plans[0].blocks[0], "none");
  // The second position holds fewer micro-batches in flight: where it fits without checkpointing,
  // it checkpoints nothing.
  const double target = static_cast<double>(c.memory.budget_mb) * (1 << 20) / 1.05;
  std::cout << "second position without checkpointing: " << none_at[1] / (1 << 20) << " MiB\n";
  if (none_at[1] <= target)
    EXPECT_EQ(std::vector<std::string>(plans[0].blocks.begin() + 3, plans[0].blocks.end()),
              std::vector<std::string>(3, "none"));
  EXPECT_LE(static_cast<double>(plans[0].peak_bytes), static_cast<double>(c.memory.budget_mb) * (1 << 20) / 1.05);
}

// Plain training under the budget: no block is checkpointed, and nothing is profiled. A budget
// below full checkpointing's peak: an error with that peak.
TEST(MemoryBudget, SaysWhenPlainTrainingFitsAndWhenNothingDoes) {
  const std::string dir = test::scratch_dir("memory_budget_edges");
  TrainConfig c = budget_config(dir);
  c.parallel.dp_shard = 1;
  testing::run_ranks(
      1,
      [&](const comm::ProcessGroup& world) {
        c.memory.budget_mb = 1 << 20;
        const detail::MemoryPlan roomy = detail::plan_memory(c, world);
        EXPECT_EQ(roomy.blocks, std::vector<std::string>(4, "none"));
        EXPECT_EQ(roomy.seconds_per_micro_batch, 0.0);
        EXPECT_NE(roomy.report.find("which fits: no block is checkpointed"), std::string::npos) << roomy.report;
        c.memory.budget_mb = 1;
        test::expect_error([&] { detail::plan_memory(c, world); },
                           {"memory.budget_mb 1 is below what any plan needs: full checkpointing of every block "
                            "peaks at",
                            "raise the budget"});
      },
      ranks_for(c));
}

}  // namespace
}  // namespace hp::train
