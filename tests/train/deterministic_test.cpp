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

Outcome train_with(const ParallelDims& dims, bool sequence_parallel, const std::string& name) {
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

TEST(DeterministicTraining, TheWorldGroupMustMatchTheConfig) {
  TrainConfig c;
  c.train.deterministic = true;
  test::run(1, [&](const comm::ProcessGroup& world) {  // created without determinism
    test::expect_error([&] { train(c, world); }, "train.deterministic is true but the world group was created not");
  });
}

}  // namespace
}  // namespace hp::train
