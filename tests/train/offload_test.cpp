// memory.offload (hp/parallel/offload.h) in the trainer: keeping the sharded parameters, gradients
// and optimizer state in the host or the file tier changes no bit of the run, on one rank (units of
// one rank), under FSDP x TP, TP alone, HSDP, through a 1F1B pipeline and with Muon; a run stopped and resumed from
// its checkpoint with the file tier continues bitwise (the load writes into the tier).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "hp/models/llama/spec.h"
#include "hp/train/trainer.h"
#include "parallel/swap_tier.h"
#include "scratch_dir.h"
#include "test_util.h"
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

}  // namespace
}  // namespace hp::train
