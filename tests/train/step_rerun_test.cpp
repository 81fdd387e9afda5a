// Rerun on an anomaly (resilience.rerun_on_anomaly): a step whose numbers are not finite, or spike,
// runs again from its start; the same numbers again are persistent (the data or the model), other
// numbers a transient fault, after which the run goes on with the rerun's step, bitwise as if
// nothing had happened.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "hp/dcp/checkpoint.h"
#include "hp/models/qwen3_moe/spec.h"
#include "hp/nn/moe.h"
#include "hp/nn/token_coordinates.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/step_rerun.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;

// Two ranks (dp_shard 2) of the small Llama with dropout, whose masks come from each module's
// count of its draws in the step: a rerun that did not count again from the first would draw other
// masks.
TrainConfig small_config(const std::string& name) {
  const fs::path dir = test::scratch_dir("hp_step_rerun_" + name);
  TrainConfig c = small_llama_config(dir);
  c.seed = 5;
  c.train.steps = 6;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.optimizer.lr = 3e-3;
  c.parallel.dp_shard = 2;
  c.model.as<models::LlamaConfig>().residual_dropout = 0.1;
  c.model.as<models::LlamaConfig>().attention_dropout = 0.1;
  return c;
}

TrainConfig rerunning(TrainConfig c, const std::string& faults, double spike_factor = 0.0) {
  c.resilience.rerun_on_anomaly = true;
  c.resilience.spike_factor = spike_factor;
  c.resilience.faults = faults;
  return c;
}

void expect_bitwise(const std::vector<double>& a, const std::vector<double>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::memcmp(&a[i], &b[i], sizeof(double)), 0) << "step " << i + 1 << ": " << a[i] << " vs " << b[i];
}

// A NaN in one rank's gradient in step 4's first run only: the rerun gives finite numbers, the step
// is classified transient, and every loss and gradient norm is bitwise those of a run without the
// fault (dropout included). Without the rerun the same fault stops the run.
TEST(StepRerun, ATransientNaNRunsAgainAndTheRunGoesOnBitwise) {
  const TrainConfig clean = small_config("clean");
  const TrainResult expected = rank0_result(clean, 2);
  const TrainConfig c = rerunning(small_config("transient"), "nan:1:4");
  const TrainResult got = rank0_result(c, 2);
  EXPECT_EQ(got.transient_faults, 1);
  EXPECT_EQ(got.persistent_anomalies, 0);
  expect_bitwise(got.losses, expected.losses);
  expect_bitwise(got.grad_norms, expected.grad_norms);
  EXPECT_EQ(got.eval_loss, expected.eval_loss);
  const auto records = train_records(c);
  ASSERT_EQ(records.size(), 6u);
  for (const auto& r : records) EXPECT_EQ(r.contains("rerun"), r.at("step") == 4) << r.dump();
  EXPECT_EQ(records[3].at("rerun"), "transient");

  TrainConfig without = small_config("without_rerun");
  without.resilience.faults = "nan:1:4";
  test::expect_error([&] { train_on_ranks(without, 2); }, "step 4: ");
}

// The same NaN in every run of step 4 (a bad batch): persistent, and then train.on_nonfinite
// decides: stop names it, skip skips it.
TEST(StepRerun, APersistentNaNIsClassifiedPersistent) {
  const TrainConfig stops = rerunning(small_config("persistent_stop"), "nan:1:4:always");
  test::expect_error([&] { train_on_ranks(stops, 2); },
                     "(not finite again when the step ran again: the data or the model)");
  TrainConfig skips = rerunning(small_config("persistent_skip"), "nan:0:4:always");
  skips.train.on_nonfinite = "skip";
  const TrainResult got = rank0_result(skips, 2);
  EXPECT_EQ(got.persistent_anomalies, 1);
  EXPECT_EQ(got.transient_faults, 0);
  EXPECT_EQ(got.skipped_steps, 1);
  EXPECT_EQ(train_records(skips)[3].at("rerun"), "persistent");
}

// A rank's gradients times 1000 in step 5: the gradient norm spikes past 10x the previous steps'.
// Once: transient, and the run is bitwise the clean one. In every run: persistent, and the step
// goes on as computed (the run then differs from the clean one).
TEST(StepRerun, AGradientSpikeIsRunAgainAndClassified) {
  const TrainResult expected = rank0_result(small_config("spike_clean"), 2);
  const TrainResult transient = rank0_result(rerunning(small_config("spike_once"), "spike:0:5:1000", 10.0), 2);
  EXPECT_EQ(transient.transient_faults, 1);
  EXPECT_EQ(transient.persistent_anomalies, 0);
  expect_bitwise(transient.losses, expected.losses);
  expect_bitwise(transient.grad_norms, expected.grad_norms);
  const TrainResult persistent =
      rank0_result(rerunning(small_config("spike_always"), "spike:0:5:1000:always", 10.0), 2);
  EXPECT_EQ(persistent.persistent_anomalies, 1);
  EXPECT_EQ(persistent.transient_faults, 0);
  ASSERT_EQ(persistent.grad_norms.size(), 6u);
  EXPECT_GT(persistent.grad_norms[4], 10.0 * expected.grad_norms[4]);
  // Without a spike factor, a spike is no anomaly.
  const TrainResult unwatched = rank0_result(rerunning(small_config("spike_unwatched"), "spike:0:5:1000"), 2);
  EXPECT_EQ(unwatched.transient_faults + unwatched.persistent_anomalies, 0);
}

// resilience.on_transient_fault: stop ends the run at the transient step, naming it, with the last
// good step saved as last words.
TEST(StepRerun, OnTransientFaultStopSavesTheLastGoodStep) {
  TrainConfig c = rerunning(small_config("transient_stop"), "nan:1:4");
  c.resilience.on_transient_fault = "stop";
  c.checkpoint.interval = 10;
  test::expect_error([&] { train_on_ranks(c, 2); },
                     "a transient fault of the hardware. Stopped before the optimizer step "
                     "(resilience.on_transient_fault: stop), and step 3 is saved as last words in");
  const std::string saved = c.checkpoint_dir() + "/step-000003";
  EXPECT_EQ(dcp::latest_checkpoint(c.checkpoint_dir()), saved);
  EXPECT_EQ(dcp::load_whole(saved).values.value("last_words", ""), "transient fault at step 4");
}

// A mixture of experts counts each step's routed and dropped rows for its balancing: the first run
// of a rerun step must not count. Its records (dropped rows per layer) and losses are the clean
// run's, with train.deterministic off (the other tests have it on).
TEST(StepRerun, AMixtureOfExpertsCountsARerunStepOnce) {
  const auto moe_config = [](const std::string& name) {
    TrainConfig c = parse_config(
        "model: {family: qwen3_moe, vocab: 256, dim: 32, heads: 4, kv_heads: 2, layers: 2, max_seq: 32, top_k: 2, "
        "experts: 4, expert_hidden: 48, capacity_factor: 1.0, capacity_policy: drop_lowest, "
        "load_balance_rate: 0.01}",
        {});
    const TrainConfig small = small_config(name);
    c.run_dir = small.run_dir;
    c.data = small.data;
    c.eval = small.eval;
    c.resilience.collective_timeout_s = small.resilience.collective_timeout_s;
    c.seed = 3;
    c.train.steps = 5;
    c.train.global_batch = 4;
    c.train.micro_batch = 2;
    c.parallel.dp_shard = 2;
    c.train.deterministic = false;  // FSDP reduces each micro-batch's gradients as they come
    return c;
  };
  const TrainConfig clean = moe_config("moe_clean");
  const TrainResult expected = rank0_result(clean, 2);
  const TrainConfig c = rerunning(moe_config("moe_transient"), "nan:0:3");
  const TrainResult got = rank0_result(c, 2);
  EXPECT_EQ(got.transient_faults, 1);
  expect_bitwise(got.losses, expected.losses);
  const auto clean_records = train_records(clean), records = train_records(c);
  ASSERT_EQ(records.size(), clean_records.size());
  bool dropped_any = false;
  for (size_t i = 0; i < records.size(); ++i)
    for (const auto& [key, value] : clean_records[i].items())
      if (key.find(".dropped") != std::string::npos) {
        EXPECT_EQ(records[i].at(key), value) << key << " of step " << i + 1;
        dropped_any = dropped_any || value.get<double>() > 0;
      }
  EXPECT_TRUE(dropped_any) << "capacity_factor 1 dropped no rows: the test checks nothing";
}

// A pipeline (zbv, ordered for the costs its second step measures) reruns that very step: the
// rerun runs the first run's order and is not profiled again, and the run is bitwise the clean one.
// (Whether the order changes from step 3 on depends on the costs measured: both cases pass.)
TEST(StepRerun, APipelineStepRunsAgainBitwise) {
  const auto pipelined = [](const std::string& name) {
    TrainConfig c = small_config(name);
    c.model.as<models::LlamaConfig>().layers = 4;
    c.parallel.dp_shard = 1;
    c.parallel.pp = 2;
    c.pp_schedule = "zbv";
    c.train.global_batch = 8;  // 4 micro-batches: sums of 3 or more depend on the order of their terms
    return c;
  };
  const TrainResult expected = rank0_result(pipelined("pp_clean"), 2);
  const TrainResult got = rank0_result(rerunning(pipelined("pp_transient"), "nan:1:2"), 2);
  EXPECT_EQ(got.transient_faults, 1);
  expect_bitwise(got.losses, expected.losses);
  expect_bitwise(got.grad_norms, expected.grad_norms);
  ASSERT_TRUE(got.pipeline_profile.has_value());
  EXPECT_EQ(got.pipeline_profile->step, 2);
}

// The watch: non-finite numbers; spikes against the largest of the last 10 finite steps, looked for
// once 3 are known; two runs are the same when bitwise equal or both NaN.
TEST(AnomalyWatch, FindsNonFiniteNumbersAndSpikes) {
  const auto step = [](double loss, double grad_norm) {
    StepRecord r;
    r.loss = loss;
    r.grad_norm = grad_norm;
    return r;
  };
  detail::AnomalyWatch watch(10.0);
  EXPECT_EQ(watch.anomaly(step(NAN, 1.0)), "loss not finite");
  EXPECT_EQ(watch.anomaly(step(1.0, INFINITY)), "gradient norm not finite");
  watch.note(step(1.0, 1.0));
  watch.note(step(2.0, 1.0));
  EXPECT_FALSE(watch.anomaly(step(100.0, 1.0)));  // 2 steps known: too few to call a spike
  watch.note(step(NAN, 1.0));                     // not finite: not in the window
  EXPECT_FALSE(watch.anomaly(step(100.0, 1.0)));
  watch.note(step(3.0, 2.0));
  EXPECT_FALSE(watch.anomaly(step(30.0, 20.0)));  // at 10x the largest: not above
  EXPECT_EQ(watch.anomaly(step(30.5, 1.0)), "loss 30.5 is 10.1667x the largest of the previous 3 steps' (3)");
  EXPECT_EQ(watch.anomaly(step(1.0, 21.0)), "gradient norm 21 is 10.5x the largest of the previous 3 steps' (2)");
  for (int i = 0; i < 10; ++i) watch.note(step(0.5, 0.5));  // the first three leave the window
  EXPECT_TRUE(watch.anomaly(step(6.0, 0.5)));
  EXPECT_FALSE(detail::AnomalyWatch(0.0).anomaly(step(1e9, 1e9)));  // spikes off

  EXPECT_TRUE(detail::same_numbers(step(NAN, 1.0), step(-NAN, 1.0)));
  EXPECT_TRUE(detail::same_numbers(step(2.0, 1.0), step(2.0, 1.0)));
  EXPECT_FALSE(detail::same_numbers(step(0.0, 1.0), step(-0.0, 1.0)));  // bitwise
  EXPECT_FALSE(detail::same_numbers(step(2.0, 1.0), step(std::nextafter(2.0, 3.0), 1.0)));
}

// A module's draws in a step are numbered from its first again when the step runs again.
TEST(DrawCounter, ARerunOfAStepDrawsTheSameStreams) {
  nn::TokenCoordinates where;
  where.step = 4;
  nn::DrawCounter draws;
  std::vector<uint64_t> first, again;
  {
    const nn::TokenCoordinatesScope scope(where);
    first = {draws.next().stream, draws.next().stream};
  }
  where.run = 1;
  {
    const nn::TokenCoordinatesScope scope(where);
    again = {draws.next().stream, draws.next().stream};
  }
  EXPECT_EQ(again, first);
  EXPECT_NE(first[0], first[1]);
}

TEST(StepRerun, ConfigErrors) {
  TrainConfig c = small_config("config");
  c.resilience.spike_factor = 10.0;
  test::expect_error([&] { validate(c, 2); }, "set resilience.rerun_on_anomaly: true");
  c.resilience.rerun_on_anomaly = true;
  c.resilience.spike_factor = 0.5;
  test::expect_error([&] { validate(c, 2); }, "resilience.spike_factor must be 0 (off) or above 1, got 0.5");
  c.resilience.spike_factor = 0;
  c.resilience.on_transient_fault = "ignore";
  test::expect_error([&] { validate(c, 2); },
                     "resilience.on_transient_fault 'ignore' is unknown (available: continue, stop)");
  c.resilience.rerun_on_anomaly = false;  // an unknown value is named first
  test::expect_error([&] { validate(c, 2); }, "resilience.on_transient_fault 'ignore' is unknown");
  // On cuda it needs deterministic kernels: CudaTraining.WhatTheGpuPathDoesNotCoverIsRefused.
}

}  // namespace
}  // namespace hp::train
