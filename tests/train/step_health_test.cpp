// What the trainer watches in each step: every rank's local loss and gradient norm in the metrics,
// a loss or gradient that is not finite (the run stops naming the rank and the parameter, with the
// last checkpoint intact, or skips the step).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "hp/dcp/checkpoint.h"
#include "hp/models/llama/spec.h"
#include "hp/testing/run_ranks.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;

TrainConfig small_config(const std::string& name) {
  const fs::path dir = test::scratch_dir("hp_step_health_" + name);
  TrainConfig c = small_llama_config(dir);
  c.seed = 7;
  c.train.steps = 6;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.optimizer.lr = 3e-3;
  c.parallel.dp_shard = 2;
  return c;
}

// A learning rate of 1e30 makes AdamW's first update about 1e30 per weight: the next forward
// overflows fp32.
TrainConfig diverging(const std::string& name) {
  TrainConfig c = small_config(name);
  c.optimizer.lr = 1e30;
  c.train.max_grad_norm = 0.0;
  c.schedule.decay = "constant";
  c.checkpoint.interval = 1;
  c.checkpoint.keep = 10;
  return c;
}

// The step numbers of the run's committed checkpoints.
std::vector<int64_t> checkpoint_steps(const TrainConfig& c) {
  std::vector<int64_t> steps;
  for (const auto& entry : fs::directory_iterator(c.checkpoint_dir()))
    if (entry.path().filename().string().rfind("step-", 0) == 0)
      steps.push_back(std::stoll(entry.path().filename().string().substr(5)));
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string step_dir(const TrainConfig& c, int64_t step) {
  std::string name = std::to_string(step);
  return c.checkpoint_dir() + "/step-" + std::string(6 - name.size(), '0') + name;
}

// Each record holds both ranks' numbers; their squares add up to the global norm's (every gradient
// element is counted on one rank), their mean is the loss, and the named rank has the largest.
TEST(StepHealth, MetricsHoldEveryRanksLossAndGradientNorm) {
  const TrainConfig c = small_config("ranks");
  rank0_result(c, 2);
  const auto records = train_records(c);
  ASSERT_EQ(records.size(), 6u);
  for (const auto& r : records) {
    const auto norms = r.at("local_grad_norms").get<std::vector<double>>();
    const auto losses = r.at("local_losses").get<std::vector<double>>();
    ASSERT_EQ(norms.size(), 2u);
    ASSERT_EQ(losses.size(), 2u);
    const double global = r.at("grad_norm").get<double>();
    EXPECT_NEAR(std::sqrt(norms[0] * norms[0] + norms[1] * norms[1]), global, 1e-12 * global);
    EXPECT_NEAR((losses[0] + losses[1]) / 2, r.at("loss").get<double>(), 1e-12 * r.at("loss").get<double>());
    EXPECT_NE(losses[0], losses[1]) << "each rank's own rows";
    EXPECT_EQ(r.at("largest_local_grad_norm_rank").get<int64_t>(), norms[1] > norms[0] ? 1 : 0);
  }
}

// train.on_nonfinite: stop (the default): every rank fails at the first step whose gradients are
// not finite, naming it and each rank's first such gradient (here the loss stays finite), and the
// last checkpoint is the step before, complete; nothing newer was written.
TEST(StepHealth, ANonFiniteStepStopsTheRunNamingWhere) {
  const TrainConfig c = diverging("stop");
  std::string message;
  try {
    train_on_ranks(c, 2);
  } catch (const Error& e) {
    message = e.what();
  }
  ASSERT_NE(message.find("the first gradient that is not finite: "), std::string::npos) << message;
  EXPECT_NE(message.find("embed.weight on rank 0"), std::string::npos) << message;
  EXPECT_NE(message.find(" on rank 1"), std::string::npos) << message;
  EXPECT_NE(message.find("train.on_nonfinite: stop"), std::string::npos) << message;
  const auto at = message.find("step ");
  ASSERT_NE(at, std::string::npos) << message;
  const int64_t failed = std::stoll(message.substr(at + 5));
  ASSERT_GE(failed, 2) << message;
  EXPECT_EQ(checkpoint_steps(c).back(), failed - 1) << message;
  const dcp::StateDict last = dcp::load_whole(step_dir(c, failed - 1));  // complete: every checksum matches
  for (const auto& [name, t] : last.tensors) {
    if (t.is_floating_point()) {
      EXPECT_TRUE(at::isfinite(t).all().item<bool>()) << name;
    }
  }
}

// Last words on a step that is not finite: with no checkpoint interval near it, the last good step
// is saved anyway, marked, and becomes latest; its contents are bitwise those of the interval save
// of that step in a run that checkpoints every step (the parameters and optimizer state had not
// moved on).
TEST(StepHealth, AStopOnANonFiniteStepSavesTheLastGoodStep) {
  const TrainConfig every_step = diverging("last_words_reference");
  EXPECT_THROW(train_on_ranks(every_step, 2), Error);  // run_ranks names the ranks
  TrainConfig c = diverging("last_words");
  c.checkpoint.interval = 100;
  std::string message;
  try {
    train_on_ranks(c, 2);
  } catch (const Error& e) {
    message = e.what();
  }
  const int64_t failed = std::stoll(message.substr(message.find("step ") + 5));
  const std::string saved = step_dir(c, failed - 1);
  EXPECT_NE(message.find("step " + std::to_string(failed - 1) + " is saved as last words in " + saved),
            std::string::npos)
      << message;
  EXPECT_EQ(dcp::latest_checkpoint(c.checkpoint_dir()), saved);
  const dcp::StateDict last_words = dcp::load_whole(saved),
                       reference = dcp::load_whole(step_dir(every_step, failed - 1));
  EXPECT_EQ(last_words.values.value("last_words", ""), "not finite at step " + std::to_string(failed));
  ASSERT_EQ(last_words.tensors.size(), reference.tensors.size());
  for (const auto& [name, t] : reference.tensors) EXPECT_TRUE(at::equal(last_words.tensors.at(name), t)) << name;
}

// train.on_nonfinite: skip: the run finishes, the steps that are not finite are marked and
// counted, and they change nothing: the parameters and optimizer state at the end are bitwise
// those of the last finite step's checkpoint.
TEST(StepHealth, NonFiniteStepsCanBeSkipped) {
  TrainConfig c = diverging("skip");
  c.train.on_nonfinite = "skip";
  const TrainResult result = rank0_result(c, 2);
  ASSERT_GE(result.skipped_steps, 1);
  const auto records = train_records(c);
  ASSERT_EQ(records.size(), 6u);
  const int64_t first_skipped = 6 - result.skipped_steps + 1;
  for (const auto& r : records)
    EXPECT_EQ(r.value("skipped", false), r.at("step").get<int64_t>() >= first_skipped) << r.dump();
  ASSERT_GE(first_skipped, 2);
  const dcp::StateDict good = dcp::load_whole(step_dir(c, first_skipped - 1)), end = dcp::load_whole(step_dir(c, 6));
  for (const auto& [name, t] : good.tensors) EXPECT_TRUE(at::equal(end.tensors.at(name), t)) << name;
}

}  // namespace
}  // namespace hp::train
