// hp-plan as a user runs it: calibrate on the ranks hprun starts, plan a job with the calibration,
// and train the layout it wrote with hp-train; bad arguments refused with exit 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "e2e/e2e_util.h"
#include "hp_build_paths.h"
#include "scratch_dir.h"

namespace {

// examples/tiny_llama.yaml made small enough to calibrate in seconds.
std::string small_model(const std::string& dir) {
  return "--config " + std::string(HP_SOURCE_DIR) +
         "/examples/tiny_llama.yaml --set model.dim=64 --set model.ffn_hidden=128 --set model.heads=4 "
         "--set model.kv_heads=2 --set model.layers=2 --set model.max_seq=32 --set data.seq_len=32 "
         "--set train.global_batch=4 --set train.micro_batch=2 --set run_dir=" +
         dir + "/run --set data.cache_dir=" + dir + "/data";
}

std::string plan(const std::string& args) { return hp::e2e::bin_dir() + "/hp-plan " + args; }

TEST(HpPlan, CalibratesPlansAndWritesAConfigHpTrainRuns) {
  const std::string dir = hp::test::scratch_dir("hp_plan");
  const hp::e2e::Result calibrated = hp::e2e::run_job("--nproc-per-node 2 -- " + hp::e2e::bin_dir() + "/hp-plan " +
                                                      small_model(dir) + " --calibrate " + dir + "/calibration.json");
  ASSERT_EQ(calibrated.exit_code, 0) << calibrated.output;
  EXPECT_NE(calibrated.output.find("dp_shard 2, micro_batch 2 (trained)"), std::string::npos) << calibrated.output;
  const hp::e2e::Result planned =
      hp::e2e::run_command(plan(small_model(dir) + " --world 2 --calibration " + dir + "/calibration.json --out " +
                                dir + "/plan.yaml --json " + dir + "/ranked.json --quiet"));
  ASSERT_EQ(planned.exit_code, 0) << planned.output;
  EXPECT_NE(planned.output.find("step ms"), std::string::npos) << planned.output;
  EXPECT_NE(planned.output.find("the fastest that fits, "), std::string::npos) << planned.output;
  std::stringstream ranked;
  ranked << std::ifstream(dir + "/ranked.json").rdbuf();
  EXPECT_NE(ranked.str().find("\"step_seconds\""), std::string::npos);
  // The config it wrote trains.
  const hp::e2e::Result trained =
      hp::e2e::run_job("--nproc-per-node 2 -- " + hp::e2e::bin_dir() + "/hp-train --config " + dir +
                       "/plan.yaml --set train.steps=2 --set schedule.warmup_steps=1 --set eval.interval=0 "
                       "--set checkpoint.interval=0 --set sample.tokens=0 --no-progress");
  EXPECT_EQ(trained.exit_code, 0) << trained.output;
  // hp-train --dry-run predicts a layout's step time from the same calibration.
  const std::string train = "--nproc-per-node 2 -- " + hp::e2e::bin_dir() + "/hp-train " + small_model(dir) +
                            " --set parallel.dp_shard=2 --set parallel.tp=1 --dry-run";
  const hp::e2e::Result dry = hp::e2e::run_job(train + " --calibration " + dir + "/calibration.json");
  ASSERT_EQ(dry.exit_code, 0) << dry.output;
  EXPECT_NE(dry.output.find("step time: "), std::string::npos) << dry.output;
  EXPECT_NE(dry.output.find(" ms predicted from " + dir + "/calibration.json"), std::string::npos) << dry.output;
  std::ofstream(dir + "/not_one.json") << "[1, 2]";
  const hp::e2e::Result refused = hp::e2e::run_job(train + " --calibration " + dir + "/not_one.json");
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("--calibration: " + dir + "/not_one.json: calibration: no 'ranks'"), std::string::npos)
      << refused.output;
  // Without a calibration: memory only. A limit nothing fits in: exit 1, nothing written.
  const hp::e2e::Result memory_only =
      hp::e2e::run_command(plan(small_model(dir) + " --world 2 --quiet --out " + dir + "/memory.yaml"));
  EXPECT_EQ(memory_only.exit_code, 0) << memory_only.output;
  EXPECT_NE(memory_only.output.find("checked for memory only"), std::string::npos) << memory_only.output;
  EXPECT_NE(memory_only.output.find("the one of the smallest peak, "), std::string::npos) << memory_only.output;
  const hp::e2e::Result nothing_fits = hp::e2e::run_command(
      plan(small_model(dir) + " --world 2 --quiet --memory-limit 0.0001 --out " + dir + "/none.yaml"));
  EXPECT_EQ(nothing_fits.exit_code, 1) << nothing_fits.output;
  EXPECT_NE(nothing_fits.output.find("no layout fits in 0.0001 GiB; nothing written"), std::string::npos)
      << nothing_fits.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/none.yaml"));
}

TEST(HpPlan, BadArgumentsAreRefusedWithExit2) {
  const std::string dir = hp::test::scratch_dir("hp_plan_bad");
  for (const auto& [args, reason] : std::vector<std::pair<std::string, std::string>>{
           {"--world 2", "--config FILE is required"},
           {small_model(dir), "give either --calibrate FILE (under hprun) or --world N"},
           {small_model(dir) + " --world 2 --calibrate x.json", "give either --calibrate FILE"},
           {small_model(dir) + " --world 0", "--world expects a positive whole number"},
           {small_model(dir) + " --world 2 --memory-limit -1", "--memory-limit expects a positive number"},
           {small_model(dir) + " --world 2 --routing skewed:2", "--routing: routing model"},
           {small_model(dir) + " --world 2 --schedules zbv,nope", "--schedules: 'nope' is not a schedule"},
           {small_model(dir) + " --world 2 --schedules ,", "--schedules: '' is not a schedule"},
           {small_model(dir) + " --world 2 --schedules zbv,", "--schedules: '' is not a schedule"},
           {small_model(dir) + " --world 2 --schedules zbv,1f1b,zbv", "--schedules names zbv twice"},
           {small_model(dir) + " --world 2 --set parallel.nope=1", "hp-plan: error: "}}) {
    const hp::e2e::Result r = hp::e2e::run_command(plan(args));
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(reason), std::string::npos) << args << "\n" << r.output;
  }
  // A calibration that is not one: exit 1 naming the file's problem.
  std::ofstream(dir + "/bad.json") << "{}";
  const hp::e2e::Result bad =
      hp::e2e::run_command(plan(small_model(dir) + " --world 2 --calibration " + dir + "/bad.json"));
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("calibration: no 'ranks'"), std::string::npos) << bad.output;
}

}  // namespace
