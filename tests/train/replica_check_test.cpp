// Silent data corruption between replicas (train/replica_check.h): a bit flipped in one replica's
// parameter or gradient (HP_FAULT flip, flip_grad) is found at the next check, naming the parameter and the rank;
// healthy runs in every layout that has replicas report nothing.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>

#include "scratch_dir.h"
#include "test_util.h"
#include "train/replica_check.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

TrainConfig checked_config(const std::string& name, int64_t dp_replicate, int64_t dp_shard, int64_t tp,
                           int64_t pp = 1) {
  TrainConfig c = small_llama_config(test::scratch_dir("hp_replica_" + name));
  c.parallel.dp_replicate = dp_replicate;
  c.parallel.dp_shard = dp_shard;
  c.parallel.tp = tp;
  c.parallel.pp = pp;
  c.train.steps = 4;
  c.train.global_batch = 8;
  c.train.micro_batch = 2;
  c.resilience.replica_check_interval = 1;
  return c;
}

// Sets HP_FAULT for the scope.
struct FaultEnv {
  explicit FaultEnv(const std::string& spec) { setenv("HP_FAULT", spec.c_str(), 1); }
  ~FaultEnv() { unsetenv("HP_FAULT"); }
};

// Guards against false alarms: replicas that took the same updates are bitwise equal, in layouts
// whose replicas come from HSDP, from TP (norm weights) and across pipeline stages.
TEST(ReplicaCheck, HealthyRunsReportNothing) {
  for (const auto& [name, c] : {std::pair{"hsdp_tp", checked_config("hsdp_tp", 2, 1, 2)},
                                std::pair{"fsdp_tp", checked_config("fsdp_tp", 1, 2, 2)},
                                std::pair{"pp_hsdp", checked_config("pp_hsdp", 2, 1, 1, 2)}}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(rank0_result(c, 4).losses.size(), 4u);  // a mismatch would stop the run (on_replica_mismatch: stop)
  }
}

// Guards the detection: rank 2's copy of one parameter gets a flipped bit after step 7; the check
// every 5 steps, after step 10, names the parameter and rank 2 against the majority of its 4
// replicas, and stops.
TEST(ReplicaCheck, AFlippedBitInOneReplicaIsNamed) {
  TrainConfig c = checked_config("flip", 4, 1, 1);
  c.train.steps = 10;
  c.resilience.replica_check_interval = 5;
  const FaultEnv fault("flip:2:7:layers.1.mlp_norm.weight");
  test::expect_error([&] { train_on_ranks(c, 4); },
                     {"replicas of a parameter or of its optimizer state differ after step 10 (silent data corruption)",
                      "layers.1.mlp_norm.weight [dp_shard 0]: rank 2 differs from ranks 0, 1, 3",
                      "resilience.on_replica_mismatch: stop"});
}

// The same for a bit flipped in rank 2's gradient before step 2's optimizer step (after the
// replicas' gradients were all-reduced): its update, and so its parameter, differ from then on.
TEST(ReplicaCheck, AFlippedBitInOneReplicasGradientIsNamed) {
  TrainConfig c = checked_config("flip_grad", 4, 1, 1);
  c.resilience.replica_check_interval = 3;
  const FaultEnv fault("flip_grad:2:2:layers.1.mlp_norm.weight");
  test::expect_error([&] { train_on_ranks(c, 4); },
                     {"replicas of a parameter or of its optimizer state differ after step 3 (silent data corruption)",
                      "layers.1.mlp_norm.weight [dp_shard 0]: rank 2 differs from ranks 0, 1, 3"});
}

// The same for a bit flipped in rank 2's optimizer state of that parameter (AdamW's exp_avg)
// after step 2: named as checkpoints name it (the parameter differs too by step 3, having taken the
// corrupted update).
TEST(ReplicaCheck, AFlippedBitInOneReplicasOptimizerStateIsNamed) {
  TrainConfig c = checked_config("flip_state", 4, 1, 1);
  c.resilience.replica_check_interval = 3;
  const FaultEnv fault("flip_state:2:2:layers.1.mlp_norm.weight");
  test::expect_error([&] { train_on_ranks(c, 4); },
                     {"differ after step 3 (silent data corruption)",
                      "optim.layers.1.mlp_norm.weight.exp_avg [dp_shard 0]: rank 2 differs from ranks 0, 1, 3"});
}

// Guards what a background save may hold: the flip lands after step 2's save began staging (from
// rank 0's replica, or rank 2's); the check before that save's commit, during step 3, catches it
// and nothing is committed, so a restart cannot resume the corruption.
TEST(ReplicaCheck, ACorruptionIsCaughtBeforeTheSaveInFlightCommits) {
  TrainConfig c = checked_config("in_flight", 4, 1, 1);
  c.resilience.replica_check_interval = 100;  // only the checks that guard saves
  c.checkpoint.interval = 2;
  const FaultEnv fault("flip:2:2:layers.1.mlp_norm.weight");
  test::expect_error([&] { train_on_ranks(c, 4); },
                     {"differ after step 3", "rank 2 differs from ranks 0, 1, 3", "saving or committing anything"});
  EXPECT_FALSE(std::filesystem::exists(c.checkpoint_dir() + "/latest"));
}

// Guards the verdict: one odd replica among several is named against the majority; two replicas,
// or an even split, cannot say which side is wrong, and every rank involved is named.
TEST(ReplicaCheck, TheMajorityNamesTheOddReplica) {
  using detail::find_mismatches;
  using detail::ShardHash;
  const auto agreeing = find_mismatches({{"w", 7, 0}, {"w", 7, 1}, {"v", 1, 0}});
  EXPECT_TRUE(agreeing.mismatches.empty());
  EXPECT_EQ(agreeing.replicated_shards, 1);  // w; v has one holder
  auto one_odd = find_mismatches({{"w", 7, 0}, {"w", 7, 1}, {"w", 9, 2}, {"w", 7, 3}}).mismatches;
  ASSERT_EQ(one_odd.size(), 1u);
  EXPECT_EQ(detail::describe(one_odd), "w: rank 2 differs from ranks 0, 1, 3");
  EXPECT_EQ(detail::describe(find_mismatches({{"w [tp 0]", 7, 0}, {"w [tp 0]", 9, 1}}).mismatches),
            "w [tp 0]: ranks 0, 1 disagree, with no majority to say which is wrong");
  EXPECT_EQ(detail::describe(find_mismatches({{"w", 7, 0}, {"w", 9, 1}, {"w", 7, 2}, {"w", 9, 3}}).mismatches),
            "w: ranks 0, 1, 2, 3 disagree, with no majority to say which is wrong");
  EXPECT_EQ(
      detail::describe(find_mismatches({{"w", 7, 0}, {"w", 9, 1}, {"w", 8, 2}, {"w", 7, 3}, {"w", 7, 4}}).mismatches),
      "w: ranks 1, 2 differ from ranks 0, 3, 4");
}

// With on_replica_mismatch: warn, a mismatch is logged and the run goes on.
TEST(ReplicaCheck, WarnLetsTheRunGoOn) {
  TrainConfig c = checked_config("warn", 2, 1, 1);
  c.resilience.on_replica_mismatch = "warn";
  const FaultEnv fault("flip:1:2");
  EXPECT_EQ(rank0_result(c, 2).losses.size(), 4u);
}

// The same when a step that is not finite then stops the run: the check before its last words
// warns too, and the last words are saved (a mismatch stopped it, naming the wrong setting, when the
// check read the flag that marks an agreed end instead of the setting).
TEST(ReplicaCheck, WarnLetsAStopOnANonFiniteStepSaveItsLastWords) {
  TrainConfig c = checked_config("warn_nonfinite", 2, 1, 1);
  c.resilience.on_replica_mismatch = "warn";
  c.checkpoint.interval = 100;
  const FaultEnv fault("flip:1:1,nan:0:3:always");
  std::string message;
  try {
    train_on_ranks(c, 2);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("step 3: "), std::string::npos) << message;
  EXPECT_NE(message.find("step 2 is saved as last words in"), std::string::npos) << message;
  EXPECT_EQ(message.find("on_replica_mismatch: stop"), std::string::npos) << message;
}

}  // namespace
}  // namespace hp::train
