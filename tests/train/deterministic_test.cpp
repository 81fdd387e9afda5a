// train.deterministic in the trainer: at a fixed global batch (8 sequences) and micro-batch (2),
// the losses, gradient norms, and final parameters and optimizer state (every tensor of the last
// checkpoint) are the same bits whatever the data-parallel degree: dp_shard 1, 2 and 4; HSDP
// (dp_replicate 2 x dp_shard 2) against dp_shard 4; and, at tensor-parallel degree 2, dp_shard 1
// against 2. Clipping is active (max_grad_norm below every step's norm), so the norm matters too.
// Ranks are threads with one CPU thread each here; tests/e2e runs the same through hprun.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "hp/dcp/checkpoint.h"
#include "hp/models/llama/spec.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;

constexpr int64_t kSteps = 4;

struct Outcome {
  std::vector<double> losses, grad_norms;
  dcp::StateDict state;  // the last checkpoint, whole
};

Outcome train_with(const ParallelDims& dims, bool sequence_parallel, const std::string& name, double dropout = 0.0) {
  const fs::path dir = test::scratch_dir("hp_deterministic_" + name);
  TrainConfig c = small_llama_config(dir);
  c.seed = 5;
  c.train.steps = kSteps;
  c.train.global_batch = 8;
  c.train.micro_batch = 2;
  c.train.max_grad_norm = 0.1;
  c.optimizer.lr = 3e-3;
  c.optimizer.weight_decay = 0.01;
  c.checkpoint.interval = kSteps;
  c.parallel = dims;
  c.sequence_parallel = sequence_parallel;
  c.model.as<models::LlamaConfig>().residual_dropout = dropout;
  c.model.as<models::LlamaConfig>().attention_dropout = dropout;
  testing::RunRanksOptions ranks = ranks_for(c);
  ranks.cpu_threads_per_rank = 1;  // ATen splits reductions by thread count: the same in every run
  const TrainResult result = rank0_result(c, static_cast<int>(dims.world_size()), ranks);
  Outcome out{result.losses, result.grad_norms, dcp::load_whole(c.checkpoint_dir() + "/step-000004")};
  fs::remove_all(dir);
  return out;
}

void expect_same_bits(const Outcome& got, const Outcome& want, const std::string& what) {
  ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps)) << what;
  for (int64_t s = 0; s < kSteps; ++s) {
    EXPECT_EQ(got.losses[s], want.losses[s]) << what << ": loss of step " << s + 1;
    EXPECT_EQ(got.grad_norms[s], want.grad_norms[s]) << what << ": gradient norm of step " << s + 1;
  }
  ASSERT_EQ(got.state.tensors.size(), want.state.tensors.size()) << what;
  for (const auto& [name, tensor] : want.state.tensors) {
    ASSERT_TRUE(got.state.tensors.count(name)) << what << ": " << name;
    EXPECT_TRUE(at::equal(got.state.tensors.at(name), tensor)) << what << ": " << name;
  }
  nlohmann::json values = got.state.values, wanted = want.state.values;
  values.erase("world_size"), wanted.erase("world_size");  // what differs, on purpose
  EXPECT_EQ(values, wanted) << what;
}

ParallelDims dims(int64_t dp_replicate, int64_t dp_shard, int64_t tp) {
  ParallelDims d;
  d.dp_replicate = dp_replicate;
  d.dp_shard = dp_shard;
  d.tp = tp;
  return d;
}

TEST(DeterministicTraining, DataParallelDegreeDoesNotChangeOneBit) {
  const Outcome one = train_with(dims(1, 1, 1), false, "dp1");
  for (double norm : one.grad_norms) ASSERT_GT(norm, 0.1) << "every step must clip";
  EXPECT_NE(one.losses.front(), one.losses.back()) << "it trained";
  int64_t optimizer_tensors = 0;
  for (const auto& [name, tensor] : one.state.tensors) optimizer_tensors += name.rfind("optim.", 0) == 0;
  EXPECT_GT(optimizer_tensors, 0) << "the checkpoint holds the optimizer state";
  expect_same_bits(train_with(dims(1, 2, 1), false, "dp2"), one, "dp_shard 2 vs 1");
  const Outcome four = train_with(dims(1, 4, 1), false, "dp4");
  expect_same_bits(four, one, "dp_shard 4 vs 1");
  expect_same_bits(train_with(dims(2, 2, 1), false, "hsdp"), four, "dp_replicate 2 x dp_shard 2 vs dp_shard 4");
}

TEST(DeterministicTraining, DataParallelDegreeDoesNotChangeOneBitUnderTensorParallelism) {
  for (bool sp : {false, true}) {
    const std::string tag = sp ? "_sp" : "";
    const Outcome tp = train_with(dims(1, 1, 2), sp, "tp2" + tag);
    expect_same_bits(train_with(dims(1, 2, 2), sp, "tp2dp2" + tag), tp, "tp 2 x dp_shard 2 vs 1" + tag);
  }
}

// With residual and attention dropout (masks by global row, head and position): dp_shard 1, 2
// and 4 the same bits, and at tp 2 with SP, dp_shard 1 and 2.
TEST(DeterministicTraining, DataParallelDegreeDoesNotChangeOneBitWithDropout) {
  const Outcome one = train_with(dims(1, 1, 1), false, "dropout_dp1", 0.1);
  const Outcome without = train_with(dims(1, 1, 1), false, "no_dropout_dp1");
  EXPECT_NE(one.losses.back(), without.losses.back()) << "dropout is on";
  expect_same_bits(train_with(dims(1, 2, 1), false, "dropout_dp2", 0.1), one, "dp_shard 2 vs 1, dropout");
  expect_same_bits(train_with(dims(1, 4, 1), false, "dropout_dp4", 0.1), one, "dp_shard 4 vs 1, dropout");
  const Outcome tp = train_with(dims(1, 1, 2), true, "dropout_tp2_sp", 0.1);
  expect_same_bits(train_with(dims(1, 2, 2), true, "dropout_tp2dp2_sp", 0.1), tp,
                   "tp 2 x dp_shard 2 vs 1 (SP), dropout");
}

// Evaluation runs without dropout and leaves training as it was: evaluating after every step does
// not change one bit of the training losses.
TEST(DeterministicTraining, EvaluationDoesNotChangeTraining) {
  const auto losses = [](int64_t eval_interval) {
    const fs::path dir = test::scratch_dir("hp_deterministic_eval_" + std::to_string(eval_interval));
    TrainConfig c = small_llama_config(dir);
    c.seed = 5;
    c.train.steps = 4;
    c.eval.interval = eval_interval;
    c.model.as<models::LlamaConfig>().residual_dropout = 0.1;
    c.model.as<models::LlamaConfig>().attention_dropout = 0.1;
    const std::vector<double> out = rank0_losses(c, 1);
    fs::remove_all(dir);
    return out;
  };
  EXPECT_EQ(losses(1), losses(0));
}

// The seed is the run's random state (data order, dropout masks by step): resuming a checkpoint
// under another seed would silently start another run from its parameters, so it is an error.
TEST(DeterministicTraining, ResumingUnderAnotherSeedIsAnError) {
  const fs::path dir = test::scratch_dir("hp_deterministic_reseed");
  TrainConfig c = small_llama_config(dir);
  c.seed = 5;
  c.train.steps = 2;
  c.checkpoint.interval = 2;
  c.model.as<models::LlamaConfig>().residual_dropout = 0.1;
  train_on_ranks(c, 1);
  c.seed = 6;
  c.train.steps = 3;
  test::run(
      1,
      [&](const comm::ProcessGroup& world) {
        TrainOptions options;
        options.progress = false;
        options.resume = true;
        fail_test_on_hang(options);
        test::expect_error([&] { train(c, world, options); }, "was trained with seed 5 but the config says seed 6");
      },
      ranks_for(c));
  fs::remove_all(dir);
}

TEST(DeterministicTraining, TheWorldGroupMustMatchTheConfig) {
  TrainConfig c;
  c.train.deterministic = true;
  test::run(1, [&](const comm::ProcessGroup& world) {  // created without determinism
    test::expect_error([&] { train(c, world); }, "train.deterministic is true but the world group was created not");
  });
  // resilience.collective_timeout_s is the world's timeout, or the key would promise nothing.
  c.train.deterministic = false;
  test::run(1, [&](const comm::ProcessGroup& world) {  // the harness's 20 s
    test::expect_error([&] { train(c, world); },
                       "resilience.collective_timeout_s is 300 s but the world group's timeout is 20000 ms");
  });
}

}  // namespace
}  // namespace hp::train
