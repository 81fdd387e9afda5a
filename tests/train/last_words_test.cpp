// Last words (hp/train/stop.h): a stop request reaches every rank at the same step, which is saved,
// committed and marked before train() returns; resuming from it continues the run bitwise. The
// signals themselves, through hprun, are HpTrain.APreemptionNoticeSavesLastWordsAndTheResumeIsBitwise.
// An error in one rank: every rank names it, and the step every rank holds whole is saved.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hp/dcp/checkpoint.h"
#include "hp/models/llama/spec.h"
#include "hp/train/stop.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

// Guards the agreement (rank 1 alone asks; both stop after step 3), the save (step 3 is not a
// checkpoint interval, yet it is committed, marked and the latest) and the continuation (bitwise).
TEST(LastWords, AStopRequestSavesItsStepAndTheResumeIsBitwise) {
  const std::string dir = test::scratch_dir("hp_last_words");
  TrainConfig c = small_llama_config(dir + "/straight");
  c.train.steps = 6;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.checkpoint.interval = 4;
  c.parallel.dp_shard = 2;
  const std::vector<double> want = train_two_ranks(c, /*resume=*/false).losses;
  ASSERT_EQ(want.size(), 6u);

  c.run_dir = dir + "/stopped";
  const TrainResult stopped = train_two_ranks(c, /*resume=*/false, /*stop_rank=*/1, /*stop_step=*/3);
  EXPECT_EQ(stopped.stop_signal, SIGTERM);
  ASSERT_EQ(stopped.losses.size(), 3u);
  const std::optional<std::string> latest = dcp::latest_checkpoint(c.checkpoint_dir());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, c.checkpoint_dir() + "/step-000003");
  dcp::StateDict values;
  dcp::load(values, *latest);
  EXPECT_EQ(values.values.value("last_words", ""), "SIGTERM (a preemption notice)");

  const TrainResult resumed = train_two_ranks(c, /*resume=*/true);
  EXPECT_EQ(resumed.first_step, 3);
  EXPECT_EQ(resumed.stop_signal, 0);
  std::vector<double> got = stopped.losses;
  got.insert(got.end(), resumed.losses.begin(), resumed.losses.end());
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i + 1;
}

// Each rank's result, or its error's message, with the config's faults.
struct Outcome {
  std::vector<std::string> errors;
  TrainResult rank0;
  double seconds = 0.0;
};

Outcome run_ranks_of(const TrainConfig& c, bool resume = false) {
  Outcome out;
  out.errors.resize(4);
  testing::RunRanksOptions ranks = ranks_for(c);
  ranks.barrier_at_exit = c.resilience.faults.empty();  // a failed rank's groups are gone
  const auto t0 = std::chrono::steady_clock::now();
  testing::run_ranks(
      4,
      [&](const comm::ProcessGroup& world) {
        TrainOptions options;
        options.progress = false;
        options.resume = resume;
        fail_test_on_hang(options);
        try {
          TrainResult r = train(c, world, options);
          if (world.rank() == 0) out.rank0 = std::move(r);
        } catch (const OtherRankError& e) {
          out.errors[world.rank()] = std::string("OtherRankError: ") + e.what();
        } catch (const std::exception& e) {
          out.errors[world.rank()] = e.what();
        }
      },
      ranks);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

// 4 ranks (dp_shard 2 x tp 2, so that the ranks meet in sub-groups too) checkpointing every step:
// the reference each test compares with.
TrainConfig four_ranks(const std::string& dir, const std::string& name) {
  TrainConfig c = small_llama_config(dir + "/" + name);
  c.train.steps = 8;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.parallel.dp_shard = 2;
  c.parallel.tp = 2;
  c.checkpoint.interval = 1;
  c.checkpoint.keep = 10;
  c.resilience.collective_timeout_s = 60;
  c.model.as<models::LlamaConfig>().residual_dropout = 0.1;  // the resume must draw the same masks
  c.model.as<models::LlamaConfig>().attention_dropout = 0.1;
  return c;
}

std::string step_dir(const TrainConfig& c, int64_t step) {
  return c.checkpoint_dir() + "/step-00000" + std::to_string(step);
}

void expect_same_state(const std::string& got_dir, const std::string& want_dir) {
  const dcp::StateDict got = dcp::load_whole(got_dir), want = dcp::load_whole(want_dir);
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (const auto& [name, t] : want.tensors) EXPECT_TRUE(at::equal(got.tensors.at(name), t)) << name;
  EXPECT_EQ(got.values.at("mesh_rng"), want.values.at("mesh_rng"));
}

// Rank 2 raises after step 6's backward, while the others wait for it in collectives: each fails at
// once (not after the 60 s collective timeout: rank 2 left its groups), naming rank 2's error; they
// agree through the store that every rank holds step 5 whole, which is saved, marked and latest,
// bitwise the uninterrupted run's step 5; the resume from it continues that run bitwise.
TEST(LastWords, AnErrorInOneRankSavesTheStepEveryRankHolds) {
  const std::string dir = test::scratch_dir("hp_last_words_error");
  const TrainConfig reference = four_ranks(dir, "reference");
  const Outcome straight = run_ranks_of(reference);
  ASSERT_EQ(straight.rank0.losses.size(), 8u);

  TrainConfig c = four_ranks(dir, "failing");
  c.checkpoint.interval = 4;
  c.resilience.faults = "throw:2:6:backward";
  const Outcome failed = run_ranks_of(c);
  EXPECT_LT(failed.seconds, 30.0);
  const std::string saved = "Step 5, which every rank held, is saved in " + step_dir(c, 5);
  for (int r = 0; r < 4; ++r) {
    const std::string& e = failed.errors[r];
    EXPECT_NE(e.find(saved), std::string::npos) << r << ": " << e;
    if (r == 2)
      EXPECT_EQ(e.rfind("injected fault: rank 2 failed after step 6's backward", 0), 0u) << e;
    else
      EXPECT_EQ(e.rfind("OtherRankError: training ended because of an error on another rank (world rank 2, in step 6: "
                        "injected fault: rank 2 failed after step 6's backward)",
                        0),
                0u)
          << r << ": " << e;
  }
  ASSERT_EQ(dcp::latest_checkpoint(c.checkpoint_dir()), step_dir(c, 5));
  dcp::StateDict values;
  dcp::load(values, step_dir(c, 5));
  EXPECT_EQ(values.values.value("last_words", ""), "an error in world rank 2, in step 6");
  expect_same_state(step_dir(c, 5), step_dir(reference, 5));

  c.resilience.faults = "";
  const Outcome resumed = run_ranks_of(c, /*resume=*/true);
  EXPECT_EQ(resumed.rank0.first_step, 5);
  ASSERT_EQ(resumed.rank0.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.rank0.losses[i], straight.rank0.losses[5 + i]) << "step " << i + 6;
}

// The same on Gloo, which a rank cannot leave: the others learn of the error when their collective
// times out (3 s here), find rank 2's error, and step 5 is saved all the same.
TEST(LastWords, OnGlooTheOthersLearnOfAnErrorAtTheirTimeout) {
  const std::string dir = test::scratch_dir("hp_last_words_error_gloo");
  TrainConfig c = four_ranks(dir, "failing");
  c.comm_settings.transport = "gloo";
  c.resilience.collective_timeout_s = 3;
  c.checkpoint.interval = 4;
  c.resilience.faults = "throw:2:6:backward";
  const Outcome failed = run_ranks_of(c);
  EXPECT_GE(failed.seconds, 3.0);
  // The first to time out (the others may then see Gloo close the connections).
  EXPECT_TRUE(std::any_of(failed.errors.begin(), failed.errors.end(), [](const std::string& e) {
    return e.find("after the group timeout of 3000 ms") != std::string::npos;
  }));
  for (int r = 0; r < 4; ++r) {
    const std::string& e = failed.errors[r];
    EXPECT_NE(e.find("Step 5, which every rank held, is saved in " + step_dir(c, 5)), std::string::npos)
        << r << ": " << e;
    if (r != 2) {
      EXPECT_EQ(
          e.rfind("OtherRankError: training ended because of an error on another rank (world rank 2, in step 6", 0), 0u)
          << r << ": " << e;
    }
  }
  EXPECT_EQ(dcp::latest_checkpoint(c.checkpoint_dir()), step_dir(c, 5));
}

// Rank 2 raises after step 6, whose checkpoint is still being written in the background: that save
// is committed (every rank's part of it succeeded) and is the step every rank holds.
TEST(LastWords, AnErrorAfterAStepCommitsItsSaveInFlight) {
  const std::string dir = test::scratch_dir("hp_last_words_error_in_flight");
  const TrainConfig reference = four_ranks(dir, "reference");
  run_ranks_of(reference);
  TrainConfig c = four_ranks(dir, "failing");
  c.checkpoint.interval = 3;
  c.resilience.faults = "throw:2:6";
  const Outcome failed = run_ranks_of(c);
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(failed.errors[r].find("Step 6, which every rank held, is saved in " + step_dir(c, 6)), std::string::npos)
        << r << ": " << failed.errors[r];
  ASSERT_EQ(dcp::latest_checkpoint(c.checkpoint_dir()), step_dir(c, 6));
  dcp::StateDict values;
  dcp::load(values, step_dir(c, 6));
  EXPECT_FALSE(values.values.contains("last_words"));  // the interval's own save
  expect_same_state(step_dir(c, 6), step_dir(reference, 6));
}

// Rank 2 raises as its optimizer step begins, while the others complete theirs: no step is whole on
// every rank, so nothing is saved (step 4 stays the latest) and every rank says why.
TEST(LastWords, AnErrorInAnOptimizerStepSavesNothingTorn) {
  const std::string dir = test::scratch_dir("hp_last_words_error_torn");
  TrainConfig c = four_ranks(dir, "failing");
  c.checkpoint.interval = 4;
  c.resilience.faults = "throw:2:6:optimizer";
  const Outcome failed = run_ranks_of(c);
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(failed.errors[r].find("No last words: world ranks [2] were changing their parameters and optimizer "
                                    "state (an optimizer step)"),
              std::string::npos)
        << r << ": " << failed.errors[r];
  EXPECT_EQ(dcp::latest_checkpoint(c.checkpoint_dir()), step_dir(c, 4));
}

// Guards the process-wide request (what a signal handler makes): honoured at the first step, then
// cleared, so that a later run in the process is not stopped by it.
TEST(LastWords, TheProcesssRequestIsHonouredOnceThenCleared) {
  const std::string dir = test::scratch_dir("hp_last_words_process");
  TrainConfig c = small_llama_config(dir);
  c.train.steps = 3;
  c.train.global_batch = 2;
  c.train.micro_batch = 2;
  request_stop(SIGINT);
  const TrainResult stopped = rank0_result(c, 1);
  EXPECT_EQ(stopped.stop_signal, SIGINT);
  EXPECT_EQ(stopped.losses.size(), 1u);
  EXPECT_EQ(stop_requested(), 0);
  EXPECT_EQ(rank0_result(c, 1).losses.size(), 3u);
}

}  // namespace
}  // namespace hp::train
