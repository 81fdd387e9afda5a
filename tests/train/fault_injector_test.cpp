// The fault injector (HP_FAULT) and the trainer's report to hprun (HP_JOB_DIR): faults parse or
// fail naming the variable; a fault fires on its rank after its step, once per job; the job files
// say where the attempt started and the last step it finished. The kill kind, which ends the
// process, is exercised through hprun (HpTrain.*Restart*, HpTrain.KillAndResume*).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "hp/core/job.h"
#include "hp/train/trainer.h"
#include "scoped_env.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/fault_injector.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;
using detail::FaultKind;
using detail::parse_faults;
using test::ScopedEnv;

// Three steps of the small Llama for one rank, under `dir`.
TrainConfig three_steps(const std::string& dir) {
  TrainConfig c = small_llama_config(dir);
  c.train.steps = 3;
  c.train.global_batch = 2;
  c.train.micro_batch = 2;
  return c;
}

// Guards the documented syntax: every kind, its rank, step and delay, and each fault's index.
TEST(FaultInjector, ParsesAList) {
  const auto faults = parse_faults("kill:2:7,delay:1:5:2.5,hang:0:3,throw:1:4,flip_grad:3:2:w,flip:0:1");
  ASSERT_EQ(faults.size(), 6u);
  EXPECT_EQ(faults[0].kind, FaultKind::kKill);
  EXPECT_EQ(faults[0].rank, 2);
  EXPECT_EQ(faults[0].step, 7);
  EXPECT_EQ(faults[1].kind, FaultKind::kDelay);
  EXPECT_EQ(faults[1].seconds, 2.5);
  EXPECT_EQ(faults[2].kind, FaultKind::kHang);
  EXPECT_EQ(faults[3].kind, FaultKind::kThrow);
  EXPECT_EQ(faults[3].index, 3);
  EXPECT_EQ(faults[4].kind, FaultKind::kFlipGrad);
  EXPECT_EQ(faults[4].parameter, "w");
  EXPECT_EQ(faults[5].kind, FaultKind::kFlip);
  EXPECT_EQ(faults[5].parameter, "");
  EXPECT_TRUE(parse_faults("").empty());
  const auto anomalies = parse_faults("nan:1:4,nan:0:2:always,spike:1:3:50,spike:0:5:1e3:always");
  ASSERT_EQ(anomalies.size(), 4u);
  EXPECT_EQ(anomalies[0].kind, FaultKind::kNan);
  EXPECT_FALSE(anomalies[0].always);
  EXPECT_TRUE(anomalies[1].always);
  EXPECT_EQ(anomalies[2].kind, FaultKind::kSpike);
  EXPECT_EQ(anomalies[2].factor, 50.0);
  EXPECT_FALSE(anomalies[2].always);
  EXPECT_EQ(anomalies[3].factor, 1e3);
  EXPECT_TRUE(anomalies[3].always);
  const auto throws = parse_faults("throw:1:4,throw:1:5:backward,throw:0:2:optimizer");
  ASSERT_EQ(throws.size(), 3u);
  EXPECT_EQ(throws[0].when, "");
  EXPECT_EQ(throws[1].when, "backward");
  EXPECT_EQ(throws[2].when, "optimizer");
}

// Guards against a drill that silently injects nothing: each malformed entry is an error quoting it.
TEST(FaultInjector, RejectsMalformedFaultsNamingThem) {
  for (const char* bad : {"kill:2",
                          "boom:1:2",
                          "kill:x:7",
                          "kill:1:0",
                          "kill:-1:3",
                          "delay:1:2",
                          "kill:1:2:3",
                          "delay:1:2:-1",
                          "delay:1:2:soon",
                          "kill:1:7x",
                          "nan:1:2:sometimes",
                          "nan:1:2:always:x",
                          "spike:1:2",
                          "spike:1:2:always",
                          "spike:1:2:0",
                          "spike:1:2:inf",
                          "spike:1:2:3:often",
                          "kill:1:2:3:4:5",
                          "throw:1:2:sideways",
                          "throw:1:2:backward:x"})
    test::expect_error([&] { parse_faults(std::string("throw:0:1,") + bad); }, {"HP_FAULT", std::string("'") + bad});
}

// Guards faults from the config: resilience.faults fires as HP_FAULT does, both lists fire (claim
// files numbered across them, config first), and a malformed entry is a config error naming the key.
TEST(FaultInjector, TheConfigListsFaultsToo) {
  const std::string dir = test::scratch_dir("hp_fault_config");
  const std::string job_dir = dir + "/job";
  fs::create_directories(job_dir);
  TrainConfig c = three_steps(dir + "/run");
  c.resilience.faults = "delay:0:1:0";
  const ScopedEnv fault("HP_FAULT", "throw:0:2"), job("HP_JOB_DIR", job_dir);
  test::expect_error([&] { train_on_ranks(c, 1); }, "injected fault: rank 0 failed after step 2");
  EXPECT_TRUE(fs::exists(job_dir + "/" + job::fault_fired_file(0)));  // the config's delay
  EXPECT_TRUE(fs::exists(job_dir + "/" + job::fault_fired_file(1)));  // HP_FAULT's throw
  c.resilience.faults = "throw:0:9";
  test::expect_error([&] { validate(c, 1); },
                     "resilience.faults: 'throw:0:9' is for rank 0 at step 9, but the run has 1 ranks and 3 steps");
  c.resilience.faults = "boom:0:1";
  test::expect_error([&] { validate(c, 1); }, "resilience.faults: 'boom:0:1': unknown kind 'boom'");
}

// Guards one-shot faults: a restarted attempt passing the same step does not fire the fault again.
TEST(FaultInjector, AThrowFiresAfterItsStepOncePerJob) {
  const std::string dir = test::scratch_dir("hp_fault_injector");
  const std::string job_dir = dir + "/job";
  fs::create_directories(job_dir);
  TrainConfig c = three_steps(dir + "/run");
  const ScopedEnv fault("HP_FAULT", "throw:0:2"), job("HP_JOB_DIR", job_dir);
  test::expect_error([&] { train_on_ranks(c, 1); }, "injected fault: rank 0 failed after step 2");
  EXPECT_TRUE(fs::exists(job_dir + "/" + job::fault_fired_file(0)));
  EXPECT_EQ(job::read_number(job_dir + "/" + job::first_step_file(0)), 0);
  EXPECT_EQ(job::read_number(job_dir + "/" + job::last_step_file(0)), 2);
  // The same job again (a restart): the fault has fired, the run finishes.
  EXPECT_EQ(rank0_result(c, 1).losses.size(), 3u);
  EXPECT_EQ(job::read_number(job_dir + "/" + job::last_step_file(0)), 3);
}

// Guards the delay kind: the straggler's step takes at least its delay, and only the first time.
TEST(FaultInjector, ADelaySlowsItsStepOncePerJob) {
  const std::string dir = test::scratch_dir("hp_fault_delay");
  const std::string job_dir = dir + "/job";
  fs::create_directories(job_dir);
  TrainConfig c = three_steps(dir + "/run");
  const ScopedEnv fault("HP_FAULT", "delay:0:2:1.5"), job("HP_JOB_DIR", job_dir);
  // The delay comes before the step's own timer starts: time from one step's end to the next.
  struct StepGaps : Callback {
    std::vector<double> seconds;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
    void on_step_end(const StepRecord&) override {
      const auto now = std::chrono::steady_clock::now();
      seconds.push_back(std::chrono::duration<double>(now - last).count());
      last = now;
    }
  };
  auto first = std::make_shared<StepGaps>(), again = std::make_shared<StepGaps>();
  train_on_ranks(c, 1, {first});
  ASSERT_EQ(first->seconds.size(), 3u);
  EXPECT_GE(first->seconds[1], 1.5);
  EXPECT_LT(first->seconds[2], 1.5);
  train_on_ranks(c, 1, {again});  // the same job again: the delay has fired
  ASSERT_EQ(again->seconds.size(), 3u);
  EXPECT_LT(again->seconds[1], 1.5);
}

// A fault that could never fire is refused before any work, naming the world and the run's length.
TEST(FaultInjector, RefusesAFaultOutsideTheRun) {
  const std::string dir = test::scratch_dir("hp_fault_outside");
  TrainConfig c = three_steps(dir + "/run");
  for (const char* outside : {"kill:1:2", "throw:0:4"}) {
    const ScopedEnv fault("HP_FAULT", outside);
    test::expect_error([&] { train_on_ranks(c, 1); }, "but the run has 1 ranks and 3 steps: it would never fire");
  }
}

// Guards what a restart resumes: hprun restarts hp-train with resume_only_this_job, and the run
// directory may still hold an earlier run's checkpoint, which is not this job's to continue.
TEST(JobRestart, ResumesOnlyFromACheckpointOfItsOwnJob) {
  const std::string dir = test::scratch_dir("hp_job_restart");
  TrainConfig c = three_steps(dir + "/run");
  c.checkpoint.interval = 2;
  c.checkpoint.async = false;
  const auto first_step = [&](int64_t steps) {
    c.train.steps = steps;
    int64_t first = -1;
    test::run(
        1,
        [&](const comm::ProcessGroup& world) {
          TrainOptions options;
          options.progress = false;
          options.resume = options.resume_only_this_job = true;
          fail_test_on_hang(options);
          first = train(c, world, options).first_step;
        },
        ranks_for(c));
    return first;
  };
  c.train.steps = 6;
  train_on_ranks(c, 1);  // an earlier run, without hprun, leaves the checkpoints of steps 4 and 6
  fs::create_directories(dir + "/job");
  const ScopedEnv job("HP_JOB_DIR", dir + "/job");
  EXPECT_EQ(first_step(3), 0);  // not this job's: from the start (and it saves step 2)
  // This job's own save, which the earlier run's later checkpoints must not have pruned away.
  EXPECT_EQ(first_step(4), 2);
  fs::create_directories(dir + "/another-job");
  const ScopedEnv other_job("HP_JOB_DIR", dir + "/another-job");
  EXPECT_EQ(first_step(4), 0);
}

}  // namespace
}  // namespace hp::train
