// memory.offload (hp/parallel/offload.h) in the trainer: keeping the sharded parameters, gradients
// and optimizer state in the host or the file tier changes no bit of the run, on one rank (units of
// one rank), under FSDP x TP, TP alone, HSDP, through a 1F1B pipeline and with Muon; a run stopped and resumed from
// its checkpoint with the file tier continues bitwise (the load writes into the tier);
// memory.offload_units moves exactly the units it names, and memory.offload_prefetch changes no bit.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "hp/core/storage_tier.h"
#include "hp/dtensor/local.h"
#include "hp/models/llama/spec.h"
#include "hp/train/trainer.h"
#include "parallel/swap_tier.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/setup.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

TrainConfig offload_config(const std::string& dir) {
  TrainConfig c = small_llama_config(dir);
  c.seed = 3;
  c.train.steps = 8;
  c.train.global_batch = 8;
  c.train.micro_batch = 2;
  c.optimizer.lr = 3e-3;
  c.schedule.warmup_steps = 2;
  c.eval.interval = 0;
  return c;
}

TEST(Trainer, ParameterOffloadChangesNoLoss) {
  const std::string dir = test::scratch_dir("trainer_offload");
  struct Layout {
    std::string name;
    int64_t dp_replicate, dp_shard, tp, pp;
    std::string optimizer = "adamw";
  };
  for (const Layout& l : {Layout{"1 rank", 1, 1, 1, 1}, Layout{"dp_shard 2 x tp 2", 1, 2, 2, 1},
                          Layout{"tp 2", 1, 1, 2, 1}, Layout{"dp_replicate 2 x dp_shard 2 (HSDP)", 2, 2, 1, 1},
                          Layout{"pp 2 (1F1B)", 1, 1, 1, 2}, Layout{"dp_shard 2, muon", 1, 2, 1, 1, "muon"}}) {
    TrainConfig c = offload_config(dir + "/" + l.name);
    c.parallel.dp_replicate = l.dp_replicate;
    c.parallel.dp_shard = l.dp_shard;
    c.parallel.tp = l.tp;
    c.parallel.pp = l.pp;
    c.sequence_parallel = l.tp > 1;
    c.optimizer.name = l.optimizer;
    const int world = static_cast<int>(c.parallel.world_size());
    const std::vector<double> plain = rank0_losses(c, world);
    ASSERT_EQ(plain.size(), 8u) << l.name;
    for (const std::string tier : {"host", "file"}) {
      if (tier == "file" && hp::detail::on_copy_on_write_file_system(dir)) continue;  // refused there
      c.memory.offload = tier;
      EXPECT_EQ(rank0_losses(c, world), plain) << l.name << ", memory.offload " << tier;
    }
  }
}

TEST(Trainer, AnOffloadedRunResumesBitwise) {
  const std::string dir = test::scratch_dir("trainer_offload_resume");
  if (hp::detail::on_copy_on_write_file_system(dir)) GTEST_SKIP() << dir << " is on a copy-on-write file system";
  TrainConfig c = offload_config(dir + "/straight");
  c.parallel.dp_shard = 2;
  c.memory.offload = "file";
  c.checkpoint.interval = 3;  // and the stop's last words at step 4
  const std::vector<double> want = train_two_ranks(c, /*resume=*/false).losses;
  ASSERT_EQ(want.size(), 8u);
  c.run_dir = dir + "/stopped";
  const TrainResult stopped = train_two_ranks(c, /*resume=*/false, /*stop_rank=*/0, /*stop_step=*/4);
  ASSERT_EQ(stopped.losses.size(), 4u);
  const TrainResult resumed = train_two_ranks(c, /*resume=*/true);
  EXPECT_EQ(resumed.first_step, 4);
  std::vector<double> got = stopped.losses;
  got.insert(got.end(), resumed.losses.begin(), resumed.losses.end());
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i + 1;
}

// The units a layout's recipe makes, with memory.offload_units `units`: on every rank, the
// parameters whose storage is in the offload tier are exactly those `in_tier(pp_rank, fqn)` says.
void expect_offloaded(TrainConfig c, const std::vector<std::string>& units,
                      const std::function<bool(int64_t pp_rank, const std::string& fqn)>& in_tier) {
  c.memory.offload = "host";
  c.memory.offload_units = units;
  testing::run_ranks(
      static_cast<int>(c.parallel.world_size()),
      [&](const comm::ProcessGroup& world) {
        const detail::Setup s = detail::build(c, world);
        s.parts.init_parameters(c.seed);
        for (const auto& [fqn, p] : s.parts.named_parameters())
          EXPECT_EQ(storage_tier_of(local_tensor(p)) != nullptr, in_tier(s.mesh.get_local_rank("pp"), fqn))
              << units.front() << ": rank " << world.rank() << ", " << fqn;
      },
      ranks_for(c));
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

TrainConfig moe_config(TrainConfig c) {
  c.model = parse_config(
                "model: {family: qwen3_moe, vocab: 256, dim: 64, layers: 2, heads: 4, kv_heads: 2, "
                "max_seq: 32, experts: 4, top_k: 2, expert_hidden: 48}",
                {})
                .model;
  return c;
}

// "layers.1" takes block 1 (one rank: units of one rank); "root" the model's own unit (the
// embedding, final norm and head); "layers.*.mlp.experts" a MoE's experts and nothing else of
// their blocks; "stage.1" the second stage of a 1F1B pipeline, which pipeline rank 1 runs, with
// the experts inside it (a MoE on pp 2 x dp_shard 2, where the experts are units of their own).
TEST(Trainer, OffloadUnitsMoveOnlyTheUnitsTheyName) {
  const std::string dir = test::scratch_dir("trainer_offload_units");
  TrainConfig c = offload_config(dir);
  expect_offloaded(c, {"layers.1"}, [](int64_t, const std::string& fqn) { return starts_with(fqn, "layers.1."); });
  c.parallel.dp_shard = 2;
  expect_offloaded(c, {"root"}, [](int64_t, const std::string& fqn) { return !starts_with(fqn, "layers."); });
  expect_offloaded(moe_config(c), {"layers.*.mlp.experts"},
                   [](int64_t, const std::string& fqn) { return fqn.find(".mlp.experts.") != std::string::npos; });
  c.parallel.pp = 2;
  const auto stage_1 = [](int64_t pp_rank, const std::string&) { return pp_rank == 1; };
  expect_offloaded(moe_config(c), {"stage.1"}, stage_1);
  c.parallel.dp_shard = 1;
  expect_offloaded(c, {"stage.1"}, stage_1);
}

// A pattern that selects no unit of the layout is an error naming the layout's units (a block the
// model does not have, a stage without a pipeline), and so is one that matches a module that is no
// unit: a block under a pipeline (a MoE on pp 2 x dp_shard 2, whose experts are units inside it).
TEST(Trainer, OffloadUnitsThatNameNoUnitAreAnError) {
  const std::string dir = test::scratch_dir("trainer_offload_units_error");
  TrainConfig c = offload_config(dir);
  c.memory.offload = "host";
  for (const std::string unit : {"layers.2", "stage.0"}) {
    c.memory.offload_units = {"layers.0", unit};
    test::expect_error([&] { train_on_ranks(c, 1); },
                       "memory.offload_units: '" + unit +
                           "' selects no FSDP unit of this layout (its units: root, layers.0, layers.1)");
  }
  TrainConfig moe = moe_config(c);
  moe.parallel.pp = 2;
  moe.parallel.dp_shard = 2;
  moe.memory.offload_units = {"layers.*"};
  test::expect_error([&] { train_on_ranks(moe, 4); },
                     "memory.offload_units: 'layers.*' matches layers.0, which is not an FSDP unit of this layout");
}

// Which units are offloaded and how far ahead they gather change no bit: dp_shard 2 with the file
// tier for block 1 and the root, prefetch 0, 1 and 2, against no offload, over 8 steps with an
// evaluation every 3; and prefetch 2 with every block fully checkpointed (recomputed in backward).
TEST(Trainer, OffloadUnitsAndPrefetchChangeNoLoss) {
  const std::string dir = test::scratch_dir("trainer_offload_prefetch");
  if (hp::detail::on_copy_on_write_file_system(dir)) GTEST_SKIP() << dir << " is on a copy-on-write file system";
  TrainConfig c = offload_config(dir);
  c.parallel.dp_shard = 2;
  c.eval.interval = 3;
  const std::vector<double> plain = rank0_losses(c, 2);
  ASSERT_EQ(plain.size(), 8u);
  c.memory.offload = "file";
  c.memory.offload_units = {"layers.1", "root"};
  for (int64_t prefetch : {0, 1, 2}) {
    c.memory.offload_prefetch = prefetch;
    EXPECT_EQ(rank0_losses(c, 2), plain) << "memory.offload_prefetch " << prefetch;
  }
  c.memory.checkpoint = "full";
  EXPECT_EQ(rank0_losses(c, 2), plain) << "memory.offload_prefetch 2, memory.checkpoint full";
}

}  // namespace
}  // namespace hp::train
