// The fault injector (HP_FAULT) and the trainer's report to hprun (HP_JOB_DIR): faults parse or
// fail naming the variable; a fault fires on its rank after its step, once per job; the job files
// say where the attempt started and the last step it finished. The kill kind, which ends the
// process, is exercised through hprun (HpTrain.*Restart*, HpTrain.KillAndResume*).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <memory>
#include <string>

#include "hp/core/job.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/fault_injector.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;
using detail::FaultKind;
using detail::parse_faults;

// Sets an environment variable for the scope's lifetime.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) { setenv(name, value.c_str(), 1); }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

TEST(FaultInjector, ParsesAList) {
  const auto faults = parse_faults("kill:2:7,delay:1:5:2.5,hang:0:3,throw:1:4");
  ASSERT_EQ(faults.size(), 4u);
  EXPECT_EQ(faults[0].kind, FaultKind::kKill);
  EXPECT_EQ(faults[0].rank, 2);
  EXPECT_EQ(faults[0].step, 7);
  EXPECT_EQ(faults[1].kind, FaultKind::kDelay);
  EXPECT_EQ(faults[1].seconds, 2.5);
  EXPECT_EQ(faults[2].kind, FaultKind::kHang);
  EXPECT_EQ(faults[3].kind, FaultKind::kThrow);
  EXPECT_EQ(faults[3].index, 3);
  EXPECT_TRUE(parse_faults("").empty());
}

TEST(FaultInjector, RejectsMalformedFaultsNamingThem) {
  for (const char* bad : {"kill:2", "boom:1:2", "kill:x:7", "kill:1:0", "kill:-1:3", "delay:1:2", "kill:1:2:3",
                          "delay:1:2:-1", "delay:1:2:soon", "kill:1:7x"})
    test::expect_error([&] { parse_faults(std::string("throw:0:1,") + bad); }, {"HP_FAULT", std::string("'") + bad});
}

TEST(FaultInjector, AThrowFiresAfterItsStepOncePerJob) {
  const std::string dir = test::scratch_dir("hp_fault_injector");
  const std::string job_dir = dir + "/job";
  fs::create_directories(job_dir);
  TrainConfig c = small_llama_config(dir + "/run");
  c.train.steps = 3;
  c.train.global_batch = 2;
  c.train.micro_batch = 2;
  const ScopedEnv fault("HP_FAULT", "throw:0:2"), job("HP_JOB_DIR", job_dir);
  test::expect_error([&] { train_on_ranks(c, 1); }, "injected fault: rank 0 failed after step 2");
  EXPECT_TRUE(fs::exists(job_dir + "/" + job::fault_fired_file(0)));
  EXPECT_EQ(job::read_number(job_dir + "/" + job::first_step_file(0)), 0);
  EXPECT_EQ(job::read_number(job_dir + "/" + job::last_step_file(0)), 2);
  // The same job again (a restart): the fault has fired, the run finishes.
  EXPECT_EQ(rank0_result(c, 1).losses.size(), 3u);
  EXPECT_EQ(job::read_number(job_dir + "/" + job::last_step_file(0)), 3);
}

}  // namespace
}  // namespace hp::train
