// log.profile_step: rank 0 writes where step N's time went, by class of op and by op.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

TEST(StepProfile, TheProfiledStepsOpsAreInRunDir) {
  TrainConfig c = small_llama_config(test::scratch_dir("hp_step_profile"));
  c.train.steps = 3;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.parallel.dp_shard = 2;
  c.log.profile_step = 2;
  train_on_ranks(c, 2);
  std::ifstream in(std::filesystem::path(c.run_dir) / "profile.txt");
  ASSERT_TRUE(in) << "no profile.txt";
  std::stringstream text;
  text << in.rdbuf();
  const std::string profile = text.str();
  for (const char* want :
       {"step 2 on rank 0", "\nmatmul ", "\nelementwise ", "\nhp kernel ", "outside ops and kernels", "aten::mm"})
    EXPECT_NE(profile.find(want), std::string::npos) << want << " not in\n" << profile;
  c.log.profile_step = 4;
  test::expect_error([&] { validate(c, 2); }, "log.profile_step (4) must be a step of the run");
}

}  // namespace
}  // namespace hp::train
