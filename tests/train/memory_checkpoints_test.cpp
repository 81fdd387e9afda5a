// In-memory checkpoints and process-level recovery (docs/resilience.md#process-level-recovery), on
// ranks that are threads: the ranks train, stop after step 9 (where a rank's process dies in the
// drill), and train again in a new world, one rank with new memory (its process was started
// again): it takes its state from its buddy's copy, the others their own, and the run goes on
// bitwise. Real processes through hprun: HpTrain.ProcessLevelRecoveryRestartsOnlyTheDeadRank.
#include <gtest/gtest.h>
#include <signal.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hp/models/llama/spec.h"
#include "hp/train/memory_checkpoints.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/memory_checkpointing.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

using Memories = std::vector<std::shared_ptr<MemoryCheckpoints>>;

Memories new_memories() {
  Memories m;
  for (int r = 0; r < 4; ++r) m.push_back(std::make_shared<MemoryCheckpoints>());
  return m;
}

struct RanksRun {
  TrainResult rank0;
  std::vector<std::string> errors = std::vector<std::string>(4);
};

// 4 ranks, each with its memory of `memories`; `stop_after` > 0 ends the run after that step.
RanksRun run(const TrainConfig& c, const Memories& memories, bool recover, int64_t stop_after = 0,
             bool resume = false) {
  RanksRun out;
  std::mutex mu;
  testing::RunRanksOptions ranks = ranks_for(c);
  ranks.barrier_at_exit = false;  // a failed recovery fails every rank alike, not one
  testing::run_ranks(
      4,
      [&](const comm::ProcessGroup& world) {
        TrainOptions options;
        options.progress = false;
        options.memory_checkpoints = memories[world.rank()];
        options.recover_from_memory = recover;
        options.resume = resume;
        fail_test_on_hang(options);
        auto stop = std::make_shared<StopAt>(stop_after);
        options.callbacks.push_back(stop);
        options.stop_request = [stop] { return stop->request(); };
        try {
          TrainResult r = train(c, world, options);
          std::lock_guard<std::mutex> lock(mu);
          if (world.rank() == 0) out.rank0 = std::move(r);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mu);
          out.errors[world.rank()] = e.what();
        }
      },
      ranks);
  return out;
}

// dp_shard 2 x tp 2, with dropout (the recovered step must draw the same masks) and an in-memory
// checkpoint every 4 steps; no checkpoint on disk.
TrainConfig four_ranks(const std::string& name) {
  TrainConfig c = small_llama_config(test::scratch_dir("hp_memory_checkpoints_" + name));
  c.train.steps = 12;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.parallel.dp_shard = 2;
  c.parallel.tp = 2;
  c.checkpoint.interval = 0;
  c.resilience.in_memory_checkpoint_interval = 4;
  c.resilience.collective_timeout_s = 60;
  c.model.as<models::LlamaConfig>().residual_dropout = 0.1;
  c.model.as<models::LlamaConfig>().attention_dropout = 0.1;
  return c;
}

// Guards the state each rank gets back (parameters, optimizer state, step and scheduler: any of them
// wrong changes the losses after step 8), the buddy's copy (rank 1 has nothing of its own) and the
// checksum's retry (rank 2 damages the first copy it sends: taken as it came, step 9's loss is not
// finite).
TEST(MemoryCheckpoints, ARankWithNewMemoryTakesItsStateFromItsBuddyAndTheRunGoesOnBitwise) {
  TrainConfig c = four_ranks("straight");
  const RanksRun straight = run(c, new_memories(), /*recover=*/false);
  ASSERT_EQ(straight.rank0.losses.size(), 12u) << straight.errors[0];

  c.run_dir += "/recovered";
  Memories memories = new_memories();
  const RanksRun first = run(c, memories, /*recover=*/false, /*stop_after=*/9);
  ASSERT_EQ(first.rank0.losses.size(), 9u) << first.errors[0];
  memories[1] = std::make_shared<MemoryCheckpoints>();  // rank 1's process was started again
  c.resilience.faults = "damage_copy:2:8";
  const RanksRun recovered = run(c, memories, /*recover=*/true);
  for (const std::string& error : recovered.errors) EXPECT_EQ(error, "");
  EXPECT_EQ(recovered.rank0.first_step, 8);
  ASSERT_EQ(recovered.rank0.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(recovered.rank0.losses[i], straight.rank0.losses[8 + i]) << "step " << 9 + i;
}

// Before the first in-memory checkpoint of a run, the step it started from is held: a fresh run
// that fails after step 2 goes back to step 0; one resumed from disk at step 2 that fails after
// step 3 (the next in-memory checkpoint is at 4) goes back to step 2, not to step 0; the losses
// are the uninterrupted run's.
TEST(MemoryCheckpoints, ARecoveryBeforeTheFirstInMemoryCheckpointGoesBackToWhereTheRunStarted) {
  TrainConfig c = four_ranks("early");
  c.train.steps = 6;
  const RanksRun straight = run(c, new_memories(), /*recover=*/false);
  ASSERT_EQ(straight.rank0.losses.size(), 6u) << straight.errors[0];
  c.run_dir += "/fresh";
  Memories fresh = new_memories();
  ASSERT_EQ(run(c, fresh, /*recover=*/false, /*stop_after=*/2).rank0.losses.size(), 2u);
  fresh[3] = std::make_shared<MemoryCheckpoints>();
  const RanksRun from_zero = run(c, fresh, /*recover=*/true);
  EXPECT_EQ(from_zero.errors[0], "");
  EXPECT_EQ(from_zero.rank0.first_step, 0);
  EXPECT_EQ(from_zero.rank0.losses, straight.rank0.losses);

  c.run_dir += "/recovered";
  c.checkpoint.interval = 2;
  ASSERT_EQ(run(c, new_memories(), /*recover=*/false, /*stop_after=*/2).rank0.losses.size(), 2u);
  Memories memories = new_memories();
  const RanksRun resumed = run(c, memories, /*recover=*/false, /*stop_after=*/3, /*resume=*/true);
  ASSERT_EQ(resumed.rank0.first_step, 2) << resumed.errors[0];
  memories[3] = std::make_shared<MemoryCheckpoints>();
  const RanksRun recovered = run(c, memories, /*recover=*/true);
  EXPECT_EQ(recovered.errors[0], "");
  EXPECT_EQ(recovered.rank0.first_step, 2);
  EXPECT_EQ(recovered.rank0.losses,
            std::vector<double>(straight.rank0.losses.begin() + 2, straight.rank0.losses.end()));
}

// A rank started again takes its state from the next rank, its buddy: when that one was started
// again too, nobody holds the state, and every rank says so rather than guessing.
TEST(MemoryCheckpoints, TwoNeighboursWithNewMemoryCannotRecoverAndSaySo) {
  TrainConfig c = four_ranks("neighbours");
  c.train.steps = 5;
  Memories memories = new_memories();
  ASSERT_EQ(run(c, memories, /*recover=*/false).rank0.losses.size(), 5u);
  memories[1] = std::make_shared<MemoryCheckpoints>();
  memories[2] = std::make_shared<MemoryCheckpoints>();
  const RanksRun recovered = run(c, memories, /*recover=*/true);
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(recovered.errors[r].find("process-level recovery: no step can be had back by every rank"),
              std::string::npos)
        << "rank " << r << ": " << recovered.errors[r];
    EXPECT_NE(recovered.errors[r].find("world rank 1 nothing (started again); world rank 2 nothing (started again)"),
              std::string::npos)
        << recovered.errors[r];
  }
}

// Without memory to recover from, the options say what is missing before anything runs.
TEST(MemoryCheckpoints, RecoveringWithoutInMemoryCheckpointsIsRefused) {
  TrainConfig c = four_ranks("refused");
  c.resilience.in_memory_checkpoint_interval = 0;
  const RanksRun refused = run(c, new_memories(), /*recover=*/true);
  EXPECT_NE(refused.errors[0].find("recover_from_memory needs in-memory checkpoints"), std::string::npos)
      << refused.errors[0];
  TrainConfig one_rank = c;
  one_rank.resilience.in_memory_checkpoint_interval = 2;
  EXPECT_THROW(validate(one_rank, 1), Error);
}

// A rank's stand-in state at `step`: one tensor filled with rank * 100 + step.
at::Tensor stand_in(int rank, int64_t step) {
  dcp::StateDict state;
  state.tensors["model.w"] = at::full({4}, static_cast<double>(rank * 100 + step));
  state.values = {{"step", step}};
  return detail::pack_state(state);
}

// 4 ranks keep stand-ins of steps 4 and 8; rank 2, which keeps rank 1's copies, damages the copy of
// step 8 before it is checked, or leaves it unchecked (in flight when the world goes).
enum class Rank2CopyOf8 { kDamaged, kInFlight };
Memories keep_4_and_8(Rank2CopyOf8 rank2) {
  Memories memories = new_memories();
  testing::run_ranks(4, [&](const comm::ProcessGroup& world) {
    MemoryCheckpoints::Contents& mine = memories[world.rank()]->contents();
    detail::MemoryCheckpointing ring(*memories[world.rank()], world);
    ring.keep(4, stand_in(world.rank(), 4));
    ring.finish_exchange();
    ring.keep(8, stand_in(world.rank(), 8));
    if (world.rank() != 2) return ring.finish_exchange();
    if (rank2 == Rank2CopyOf8::kInFlight) return;
    mine.exchange->works.back().wait();  // the receive
    static_cast<uint8_t*>(mine.exchange->incoming.data_ptr())[mine.exchange->incoming.numel() - 1] ^= 1;
    ring.finish_exchange();  // warns, and keeps the copy of step 4
  });
  return memories;
}

// Rank 1's process started again: the step every rank can have back, and each rank's state of it.
std::vector<detail::MemoryCheckpointing::Recovered> recover_rank_1(Memories memories) {
  memories[1] = std::make_shared<MemoryCheckpoints>();
  std::vector<detail::MemoryCheckpointing::Recovered> back(4);
  testing::run_ranks(4, [&](const comm::ProcessGroup& world) {
    detail::MemoryCheckpointing ring(*memories[world.rank()], world);
    back[world.rank()] = ring.recover({});
  });
  return back;
}

// Guards keeping the newest two: rank 2's copy of rank 1's step 8 arrived damaged (the checksum sees
// it), so rank 1 can have only step 4 back, and every rank goes back to 4, which the others still
// hold. With one step kept, nobody could recover.
TEST(MemoryCheckpoints, ACopyThatArrivedDamagedLeavesTheStepBefore) {
  const auto back = recover_rank_1(keep_4_and_8(Rank2CopyOf8::kDamaged));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(back[r].step, 4) << "rank " << r;
    EXPECT_TRUE(at::equal(back[r].packed, stand_in(r, 4))) << "rank " << r;
  }
}

// A copy in flight when the world went counts when it arrives whole: step 8.
TEST(MemoryCheckpoints, ACopyInFlightWhenTheWorldWentCountsOnceItArrives) {
  const auto back = recover_rank_1(keep_4_and_8(Rank2CopyOf8::kInFlight));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(back[r].step, 8) << "rank " << r;
    EXPECT_TRUE(at::equal(back[r].packed, stand_in(r, 8))) << "rank " << r;
  }
}

}  // namespace
}  // namespace hp::train
