// hp-train's checkpoints carry the mesh's RNG position, per pipeline rank: a run resumed from a
// checkpoint draws from DTensor random ops what the uninterrupted run drew after that save.
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "hp/dtensor/random.h"
#include "hp/optim/lr_scheduler.h"
#include "hp/parallel/parallel_dims.h"
#include "train/checkpointing.h"
#include "train/recipe_options.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;

// A draw of the mesh's RNG: a replicated DTensor of 8 uniform values, this rank's copy.
at::Tensor draw(const DeviceMesh& mesh) {
  return DTensor(rand({8}, mesh, Placements(mesh.ndim(), Replicate()))).to_local().clone();
}

// Builds the run's model on `world` (pp 2), seeds its mesh with the run's seed, draws `draws` times,
// then either saves a checkpoint of step 1 (save) or resumes from the latest; returns the next draw.
at::Tensor draw_after(const TrainConfig& c, const comm::ProcessGroup& world, int draws, bool save) {
  DeviceMesh mesh = build_mesh(world, c.parallel);
  manual_seed(mesh, c.seed);
  models::ModelParts parts = c.model->build(mesh, c.parallel, detail::recipe_options(c));
  parts.init_parameters(c.seed);
  torch::optim::AdamW optimizer(parts.parameters(), torch::optim::AdamWOptions(1e-3));
  LRSchedule schedule;
  schedule.total_steps = 4;
  LRScheduler scheduler = get_hyper_lr_scheduler(optimizer, schedule);
  detail::Checkpointing checkpoints(c, mesh, parts, optimizer, world);
  for (int i = 0; i < draws; ++i) draw(mesh);
  if (save) {
    EXPECT_TRUE(checkpoints.save_if_due(1, scheduler).has_value());
    checkpoints.finish();
  } else {
    EXPECT_EQ(checkpoints.resume(scheduler, /*only_this_job=*/false), 1);
  }
  return draw(mesh);
}

TEST(Checkpointing, ResumeSetsTheMeshRngWhereTheSaveLeftIt) {
  const fs::path dir = fs::temp_directory_path() / ("hp_checkpoint_rng_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  TrainConfig c = small_llama_config(dir);
  c.parallel.pp = 2;
  c.train.global_batch = 2;
  c.train.micro_batch = 1;
  c.checkpoint.interval = 1;
  c.checkpoint.async = false;
  validate(c, 2);
  test::run(2, [&](const comm::ProcessGroup& world) {
    // The two pipeline stages draw different numbers of times, as stages with other modules would.
    const at::Tensor after_save = draw_after(c, world, 3 + 2 * world.rank(), /*save=*/true);
    // A fresh mesh, seeded as hp-train seeds it, drawing nothing before the resume.
    const at::Tensor after_resume = draw_after(c, world, 0, /*save=*/false);
    EXPECT_TRUE(at::equal(after_resume, after_save));
    // Without the restore, the fresh mesh would have drawn its first values: other ones.
    DeviceMesh fresh = build_mesh(world, c.parallel);
    manual_seed(fresh, c.seed);
    EXPECT_FALSE(at::equal(draw(fresh), after_save));
  });
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hp::train
