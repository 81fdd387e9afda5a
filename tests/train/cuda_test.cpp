// train.device cuda against the CPU (docs/gpu.md): the small Llama trained on one GPU gives the
// CPU's losses within a stated tolerance, in fp32 and in bf16, and a deterministic GPU run repeats
// bitwise. Skipped where the build has no HP_CUDA or no GPU is visible (the CPU machines CI runs
// on); scripts/device-check runs them on a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "has_gpu.h"
#include "hp/models/llama/spec.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

constexpr int64_t kSteps = 4;

std::vector<double> losses_on(const std::string& device, const std::string& dtype, const std::string& name) {
  const auto dir = test::scratch_dir("hp_cuda_" + name);
  TrainConfig c = small_llama_config(dir);
  c.seed = 3;
  c.train.steps = kSteps;
  c.train.global_batch = 8;
  c.train.micro_batch = 4;
  c.train.device = device;
  c.train.dtype = dtype;
  c.optimizer.lr = 3e-3;
  const std::vector<double> losses = rank0_losses(c, 1);
  std::filesystem::remove_all(dir);
  return losses;
}

// |got - want| <= rel * |want| for every step, and the largest relative difference in the message.
void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0.0;
  for (size_t s = 0; s < got.size(); ++s) {
    const double diff = std::abs(got[s] - want[s]) / std::abs(want[s]);
    worst = std::max(worst, diff);
    EXPECT_LE(diff, rel) << what << ": step " << s + 1 << " loss " << got[s] << " vs " << want[s];
  }
  std::printf("%s: largest relative loss difference %.3g (tolerance %.3g)\n", what, worst, rel);
}

TEST(CudaTraining, Fp32MatchesTheCpuRun) {
  if (!test::has_gpu()) GTEST_SKIP() << "no GPU in this build or on this machine";
  // Summation orders differ between the GPU's kernels and the CPU's: not bitwise, close.
  expect_close(losses_on("cuda", "fp32", "fp32_gpu"), losses_on("cpu", "fp32", "fp32_cpu"), 1e-4, "fp32 GPU vs CPU");
}

TEST(CudaTraining, Bf16StaysCloseToFp32) {
  if (!test::has_gpu()) GTEST_SKIP() << "no GPU in this build or on this machine";
  expect_close(losses_on("cuda", "bf16", "bf16_gpu"), losses_on("cpu", "fp32", "bf16_cpu"), 2e-2,
               "bf16 GPU vs fp32 CPU");
}

TEST(CudaTraining, ADeterministicRunRepeatsBitwise) {
  if (!test::has_gpu()) GTEST_SKIP() << "no GPU in this build or on this machine";
  const std::vector<double> first = losses_on("cuda", "bf16", "repeat_1");
  const std::vector<double> second = losses_on("cuda", "bf16", "repeat_2");
  ASSERT_EQ(first.size(), static_cast<size_t>(kSteps));
  for (int64_t s = 0; s < kSteps; ++s) EXPECT_EQ(first[s], second[s]) << "step " << s + 1;
}

// What the GPU path does not cover fails at the start, by name (config validation).
void expect_refused(const std::function<void(TrainConfig&)>& change, const std::string& says) {
  const auto dir = test::scratch_dir("hp_cuda_refused");
  TrainConfig c = small_llama_config(dir);
  c.train.device = "cuda";
  change(c);
  try {
    validate(c, c.parallel.world_size());
    ADD_FAILURE() << "accepted; expected an error saying: " << says;
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(CudaTraining, WhatTheGpuPathDoesNotCoverIsRefused) {
  expect_refused([](TrainConfig& c) { c.train.device = "gpu"; }, "train.device 'gpu' is unknown");
#ifdef HP_WITH_CUDA
  expect_refused([](TrainConfig& c) { c.parallel.dp_shard = 2; }, "trains one rank for now");
  expect_refused([](TrainConfig& c) { c.memory.swap = "host"; }, "memory.swap host is for the CPU");
  expect_refused(
      [](TrainConfig& c) {
        c.resilience.rerun_on_anomaly = true;
        c.train.deterministic = false;
      },
      "resilience.rerun_on_anomaly on cuda needs train.deterministic: true");
#else
  expect_refused([](TrainConfig&) {}, "needs the device build");
#endif
}

}  // namespace
}  // namespace hp::train
