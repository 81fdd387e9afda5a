// The same training run under different parallel configs: the loss curves agree within 1e-4
// (fp32), 20 steps from the same seed. Ranks are threads here; tests/e2e runs hp-train for real.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <utility>

#include "hp/kernels/capability.h"
#include "hp/models/llama/spec.h"
#include "hp/train/trainer.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;

TrainConfig tiny_config(const fs::path& dir) {
  TrainConfig c = small_llama_config(dir);
  c.seed = 3;
  c.train.steps = 20;
  c.train.global_batch = 8;
  c.train.micro_batch = 2;
  c.optimizer.lr = 3e-3;
  c.schedule.warmup_steps = 3;
  return c;
}

struct Parallel {
  int world;
  ParallelDims dims;
  bool sequence_parallel = false;
  bool loss_parallel = false;
  std::string name;
  std::string pp_schedule = "1f1b";
  bool tie_embeddings = false;
  int64_t layers = 2;
  std::vector<int64_t> layers_per_stage = {};  // parallel.pp_layers_per_stage
  std::string optimizer = "adamw";
  std::string cp_mode = "ring";  // parallel.cp_mode, parallel.cp_ulysses, parallel.cp_async
  int64_t cp_ulysses = 0;
  bool cp_async = false;
  double dropout = 0.0;             // model.residual_dropout and model.attention_dropout
  std::string checkpoint = "none";  // memory.checkpoint
  bool async_tp = false;            // parallel.async_tp
};

std::vector<double> run_config(const Parallel& p, const fs::path& dir) {
  TrainConfig c = tiny_config(dir);
  c.parallel = p.dims;
  c.sequence_parallel = p.sequence_parallel;
  c.loss_parallel = p.loss_parallel;
  c.pp_schedule = p.pp_schedule;
  c.model.as<models::LlamaConfig>().tie_embeddings = p.tie_embeddings;
  c.model.as<models::LlamaConfig>().layers = p.layers;
  c.pp_layers_per_stage = p.layers_per_stage;
  c.optimizer.name = p.optimizer;
  c.cp_mode = p.cp_mode;
  c.cp_ulysses = p.cp_ulysses;
  c.cp_async = p.cp_async;
  c.model.as<models::LlamaConfig>().residual_dropout = p.dropout;
  c.model.as<models::LlamaConfig>().attention_dropout = p.dropout;
  c.memory.checkpoint = p.checkpoint;
  c.async_tp = p.async_tp;
  c.run_dir += "_" + std::to_string(p.world) + "_" + std::to_string(p.layers_per_stage.size()) + p.optimizer;
  return rank0_losses(c, p.world);
}

// Every config's losses against the one-rank run `one` of the same model, within `rtol` (relative)
// at every step.
void expect_agreement(const std::vector<double>& one, std::initializer_list<Parallel> configs, const fs::path& dir,
                      double rtol = 1e-4) {
  for (const Parallel& p : configs) {
    const std::vector<double> got = run_config(p, dir);
    ASSERT_EQ(got.size(), one.size()) << p.name;
    double worst = 0.0;
    for (size_t i = 0; i < one.size(); ++i) {
      EXPECT_NEAR(got[i], one[i], rtol * std::abs(one[i])) << p.name << ", step " << i + 1;
      worst = std::max(worst, std::abs(got[i] - one[i]) / std::abs(one[i]));
    }
    std::cout << p.name << ": largest relative loss difference to 1 rank over 20 steps " << worst << "\n";
  }
}

TEST(Trainer, ParallelConfigsAgreeWithOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_configs_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::vector<double> one = run_config({1, {}, false, false, "1 rank"}, dir);
  ASSERT_EQ(one.size(), 20u);
  EXPECT_LT(one.back(), one.front() - 1.0) << "the loss should fall";
  ParallelDims dp2, tp2, dp2tp2, hsdp, hsdp_tp, pp2, pp2dp2, pp2tp2;
  pp2tp2.pp = 2;
  pp2tp2.tp = 2;
  pp2.pp = 2;
  pp2dp2.pp = 2;
  pp2dp2.dp_shard = 2;
  dp2.dp_shard = 2;
  tp2.tp = 2;
  dp2tp2.dp_shard = 2;
  dp2tp2.tp = 2;
  hsdp.dp_replicate = 2;
  hsdp.dp_shard = 2;
  hsdp_tp.dp_replicate = 2;
  hsdp_tp.dp_shard = 2;
  hsdp_tp.tp = 2;
  const auto agree_with = [&](const std::vector<double>& one, std::initializer_list<Parallel> configs) {
    expect_agreement(one, configs, dir);
  };
  agree_with(one, {Parallel{2, dp2, false, false, "dp_shard 2"}, Parallel{2, tp2, true, true, "tp 2 (SP, LP)"},
                   Parallel{4, dp2tp2, false, false, "dp_shard 2 x tp 2"},
                   Parallel{4, hsdp, false, false, "dp_replicate 2 x dp_shard 2"},
                   Parallel{8, hsdp_tp, true, true, "dp_replicate 2 x dp_shard 2 x tp 2 (SP, LP)"},
                   Parallel{2, pp2, false, false, "pp 2 (GPipe)", "gpipe"},
                   Parallel{4, pp2dp2, false, false, "pp 2 (1F1B) x dp_shard 2"},
                   Parallel{4, pp2tp2, false, false, "pp 2 (1F1B) x tp 2"},
                   Parallel{4, pp2tp2, true, true, "pp 2 (GPipe) x tp 2 (SP, LP)", "gpipe"}});
  // Tied embeddings: the first and the last pipeline stage each hold the weight, their gradients summed.
  agree_with(run_config({1, {}, false, false, "1 rank, tied", "1f1b", true}, dir),
             {Parallel{2, pp2, false, false, "pp 2 (1F1B), tied", "1f1b", true},
              Parallel{4, pp2dp2, false, false, "pp 2 (1F1B) x dp_shard 2, tied", "1f1b", true}});
  // ZBV: 4 stages of one layer on 2 ranks, each an FSDP unit whose W splits from its I. Uneven
  // stages (parallel.pp_layers_per_stage): 1 + 3 and 3 + 1 layers.
  agree_with(run_config({1, {}, false, false, "1 rank, 4 layers", "1f1b", false, 4}, dir),
             {Parallel{4, pp2dp2, false, false, "pp 2 (ZBV) x dp_shard 2", "zbv", false, 4},
              Parallel{2, pp2, false, false, "pp 2 (1F1B), 1 + 3 layers", "1f1b", false, 4, {1, 3}},
              Parallel{4, pp2dp2, false, false, "pp 2 (GPipe) x dp_shard 2, 3 + 1 layers", "gpipe", false, 4, {3, 1}}});
  // Muon for the hidden matrices (AdamW for the rest): each pipeline rank steps its own stages'.
  const auto muon = [](Parallel p) {
    p.optimizer = "muon";
    p.name += ", Muon";
    return p;
  };
  agree_with(run_config(muon({1, {}, false, false, "1 rank"}), dir),
             {muon({2, dp2, false, false, "dp_shard 2"}), muon({2, pp2, false, false, "pp 2 (1F1B)"}),
              muon({4, pp2dp2, false, false, "pp 2 (1F1B) x dp_shard 2"})});
  fs::remove_all(dir);
}

// The fused kernels (hp/kernels: SwiGLU, RMSNorm, RoPE, the attention softmax, cross-entropy)
// against one rank without them (kernels::ComposedKernelsScope): one rank with them, and FSDP, TP
// and PP with them (each rank runs them on its local pieces), within the tolerance above.
TEST(Trainer, FusedKernelsAgreeWithOneRankComposed) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_fused_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::vector<double> composed = [&] {
    const kernels::ComposedKernelsScope composed_kernels;
    return run_config({1, {}, false, false, "1 rank, composed"}, dir);
  }();
  ASSERT_EQ(composed.size(), 20u);
  EXPECT_NE(run_config({1, {}, false, false, "1 rank"}, dir), composed) << "the scope changed nothing";
  ParallelDims dp2, tp2, pp2, pp2tp2;
  dp2.dp_shard = 2;
  tp2.tp = 2;
  pp2.pp = 2;
  pp2tp2.pp = 2;
  pp2tp2.tp = 2;
  expect_agreement(composed,
                   {Parallel{1, {}, false, false, "1 rank, fused"}, Parallel{2, dp2, false, false, "dp_shard 2, fused"},
                    Parallel{2, tp2, false, false, "tp 2, fused"}, Parallel{2, pp2, false, false, "pp 2 (1F1B), fused"},
                    Parallel{4, pp2tp2, true, true, "pp 2 (GPipe) x tp 2 (SP, LP), fused", "gpipe"}},
                   dir);
  fs::remove_all(dir);
}

// ZB-H1 and ZB-H2 (one stage per rank, the backward split into I and W): pp 2, pp 2 x dp_shard 2
// with tied embeddings (the first and the last stage on different ranks, unlike ZBV).
TEST(Trainer, ZeroBubbleSchedulesAgreeWithOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_zb_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ParallelDims pp2, pp2dp2;
  pp2.pp = pp2dp2.pp = 2;
  pp2dp2.dp_shard = 2;
  expect_agreement(run_config({1, {}, false, false, "1 rank"}, dir),
                   {Parallel{2, pp2, false, false, "pp 2 (ZB-H1)", "zbh1"}}, dir);
  expect_agreement(run_config({1, {}, false, false, "1 rank, tied", "1f1b", true}, dir),
                   {Parallel{4, pp2dp2, false, false, "pp 2 (ZB-H2) x dp_shard 2, tied", "zbh2", true}}, dir);
  fs::remove_all(dir);
}

// V-Half and V-Min (the V of ZBV with less memory): 4 stages of one layer on 2 ranks, alone and
// under FSDP.
TEST(Trainer, MemoryControllableSchedulesAgreeWithOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_vmem_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ParallelDims pp2, pp2dp2;
  pp2.pp = pp2dp2.pp = 2;
  pp2dp2.dp_shard = 2;
  expect_agreement(run_config({1, {}, false, false, "1 rank, 4 layers", "1f1b", false, 4}, dir),
                   {Parallel{2, pp2, false, false, "pp 2 (V-Min)", "vmin", false, 4},
                    Parallel{4, pp2dp2, false, false, "pp 2 (V-Half) x dp_shard 2", "vhalf", false, 4}},
                   dir);
  fs::remove_all(dir);
}

// parallel.pp_costs measured: the first step measures F, I, W and send, and the later steps run the
// order built for them. Every order keeps each stage's micro-batches in order (its W passes too),
// so the losses are bitwise those of the unit-cost order and of explicit costs; only the
// interleaving of stages on a rank changes.
TEST(Trainer, ZeroBubbleOrderForMeasuredCostsChangesNoLoss) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_zb_costs_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  // ZBV: under ZB-H1 and ZB-H2 at this shape (p 2, m 4) every cost ratio tried keeps the unit
  // order, so their comparison would check nothing (their measured path runs in the test above).
  for (const char* schedule : {"zbv"}) {
    TrainConfig c = tiny_config(dir);
    c.train.steps = 6;  // step 2 measures, step 3 checks
    c.parallel.pp = 2;
    c.pp_schedule = schedule;
    c.model.as<models::LlamaConfig>().layers = 4;
    c.pp_costs = "unit";
    const std::vector<double> unit = rank0_losses(c, 2);
    // Costs for which the order differs from the unit one (a dear I, as on CPU).
    c.pp_costs = "1,2,0.5";
    ASSERT_FALSE(pp::schedule_by_name(schedule, 2, 4, 2, *pp::parse_costs(c.pp_costs)).programs ==
                 pp::schedule_by_name(schedule, 2, 4).programs)
        << schedule << ": the same order for 1:1:1.5 as for unit costs; the comparison below would check nothing";
    EXPECT_EQ(rank0_losses(c, 2), unit) << schedule << " ordered for F:I:W 1:2:0.5";
    c.pp_costs = "measured";
    const TrainResult measured = rank0_result(c, 2);
    EXPECT_EQ(measured.losses, unit) << schedule << " ordered for measured costs";
    ASSERT_TRUE(measured.pipeline_profile.has_value()) << schedule;
    const PipelineProfile& profile = *measured.pipeline_profile;
    EXPECT_GT(profile.costs.forward, 0.0);
    EXPECT_GT(profile.costs.backward_input, 0.0);
    EXPECT_GT(profile.costs.backward_weight, 0.0);
    EXPECT_GE(profile.costs.send, 0.0);
    EXPECT_EQ(profile.step, 2);
    EXPECT_LE(profile.predicted_bubble, profile.unit_order_bubble + 1e-12) << schedule;
    EXPECT_GE(profile.measured_bubble, 0.0) << schedule;
    std::cout << schedule << ": measured F " << profile.costs.forward * 1e3 << " ms, I "
              << profile.costs.backward_input * 1e3 << " ms, W " << profile.costs.backward_weight * 1e3 << " ms, send "
              << profile.costs.send * 1e3 << " ms; bubble predicted " << profile.predicted_bubble << " (unit order "
              << profile.unit_order_bubble << "), measured " << profile.measured_bubble << "\n";
  }
  fs::remove_all(dir);
}

// Context parallelism (parallel.cp): each mode, asynchronous too (ring, hybrid), and cp composed with
// FSDP, HSDP, TP (with SP) and a 1F1B pipeline, within 1e-6 of one rank at every one of 20 steps.
TEST(Trainer, ContextParallelAgreesWithOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_cp_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ParallelDims cp2, cp4, cp2dp2, cp2hsdp, cp2tp2, cp2pp2;
  cp2.cp = 2;
  cp4.cp = 4;
  cp2dp2.cp = cp2hsdp.cp = cp2tp2.cp = cp2pp2.cp = 2;
  cp2dp2.dp_shard = 2;
  cp2hsdp.dp_replicate = 2;
  cp2tp2.tp = 2;
  cp2pp2.pp = 2;
  const auto mode = [](Parallel p, const std::string& cp_mode, int64_t ulysses = 0, bool async = false) {
    p.cp_mode = cp_mode;
    p.cp_ulysses = ulysses;
    p.cp_async = async;
    return p;
  };
  expect_agreement(run_config({1, {}, false, false, "1 rank"}, dir),
                   {Parallel{2, cp2, false, false, "cp 2 (ring)"},
                    mode(Parallel{2, cp2, false, false, "cp 2 (allgather)"}, "allgather"),
                    mode(Parallel{2, cp2, false, false, "cp 2 (ulysses)"}, "ulysses"),
                    mode(Parallel{4, cp4, false, false, "cp 4 (hybrid 2 x 2)"}, "hybrid", 2),
                    mode(Parallel{2, cp2, false, false, "cp 2 (ring, async)"}, "ring", 0, true),
                    mode(Parallel{4, cp4, false, false, "cp 4 (hybrid 2 x 2, async)"}, "hybrid", 2, true),
                    Parallel{4, cp2dp2, false, false, "cp 2 (ring) x dp_shard 2"},
                    Parallel{4, cp2hsdp, false, false, "cp 2 (ring) x dp_replicate 2 (HSDP)"},
                    Parallel{4, cp2tp2, true, false, "cp 2 (ring) x tp 2 (SP)"},
                    mode(Parallel{4, cp2tp2, false, false, "cp 2 (ulysses) x tp 2"}, "ulysses"),
                    Parallel{4, cp2pp2, false, false, "cp 2 (ring) x pp 2 (1F1B)"}},
                   dir, 1e-6);
  fs::remove_all(dir);
}

// model.residual_dropout and model.attention_dropout 0.1: each rank draws its part of the one-device
// masks (by global row, head and position), so data, tensor (with SP), context (ring, Ulysses) and
// pipeline parallelism, gradient accumulation and activation checkpointing (which replays the
// masks) train one rank's curve within 1e-6 at every one of 20 steps.
Parallel with_dropout(Parallel p, const std::string& cp_mode = "ring", int64_t ulysses = 0,
                      const std::string& checkpoint = "none") {
  p.dropout = 0.1;
  p.cp_mode = cp_mode;
  p.cp_ulysses = ulysses;
  p.checkpoint = checkpoint;
  return p;
}

// Data, tensor and pipeline parallelism; and dropout does move the curve.
TEST(Trainer, DropoutAgreesWithOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_dropout_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::vector<double> one = run_config(with_dropout({1, {}, false, false, "1 rank"}), dir);
  const std::vector<double> without = run_config({1, {}, false, false, "1 rank, no dropout"}, dir);
  ASSERT_EQ(one.size(), without.size());
  EXPECT_GT(std::abs(one.back() - without.back()), 1e-3 * std::abs(without.back())) << "dropout changes training";
  ParallelDims dp2, tp2, dp2tp2, pp2, pp2tp2;
  dp2.dp_shard = dp2tp2.dp_shard = 2;
  tp2.tp = dp2tp2.tp = pp2tp2.tp = 2;
  pp2.pp = pp2tp2.pp = 2;
  expect_agreement(
      one,
      {with_dropout({2, dp2, false, false, "dp_shard 2"}), with_dropout({2, tp2, true, true, "tp 2 (SP, LP)"}),
       with_dropout({4, dp2tp2, false, false, "dp_shard 2 x tp 2"}),
       with_dropout({2, pp2, false, false, "pp 2 (1F1B)"}),
       with_dropout({4, pp2tp2, true, false, "pp 2 (GPipe) x tp 2 (SP)", "gpipe"})},
      dir, 1e-6);
  fs::remove_all(dir);
}

// Context parallelism (ring, all-gather, Ulysses with tp, hybrid) and activation checkpointing.
TEST(Trainer, DropoutAgreesWithOneRankUnderContextParallelismAndCheckpointing) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_dropout_cp_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::vector<double> one = run_config(with_dropout({1, {}, false, false, "1 rank"}), dir);
  ParallelDims dp2, cp2, cp2tp2, cp4;
  dp2.dp_shard = 2;
  cp2tp2.tp = 2;
  cp2.cp = cp2tp2.cp = 2;
  cp4.cp = 4;
  expect_agreement(one,
                   {with_dropout({2, cp2, false, false, "cp 2 (ring)"}),
                    with_dropout({2, cp2, false, false, "cp 2 (allgather)"}, "allgather"),
                    with_dropout({4, cp2tp2, false, false, "cp 2 (ulysses) x tp 2"}, "ulysses"),
                    with_dropout({4, cp4, false, false, "cp 4 (hybrid 2 x 2)"}, "hybrid", 2),
                    with_dropout({2, dp2, false, false, "dp_shard 2, checkpoint full"}, "ring", 0, "full"),
                    with_dropout({2, dp2, false, false, "dp_shard 2, checkpoint selective"}, "ring", 0, "selective")},
                   dir, 1e-6);
  fs::remove_all(dir);
}

// sample.tokens under context parallelism: each context is padded at its end to a multiple of 2 x cp,
// cut as in training, and its logits gathered back. The greedy continuation (40 bytes after a
// 5-byte prompt: contexts of every length up to max_seq 32, then cropped) is that of one rank, under
// cp 2 (ring), cp 4 (hybrid 2 x 2) and cp 2 x tp 2 with loss parallelism.
TEST(Trainer, GeneratesUnderContextParallelismAsOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_cp_sample_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto sample = [&](const Parallel& p) {
    TrainConfig c = tiny_config(dir);
    c.parallel = p.dims;
    c.sequence_parallel = p.sequence_parallel;
    c.loss_parallel = p.loss_parallel;
    c.cp_mode = p.cp_mode;
    c.cp_ulysses = p.cp_ulysses;
    c.sample.prompt = "The c";
    c.sample.tokens = 40;
    c.run_dir += "_" + std::to_string(p.world) + "_" + p.cp_mode;
    return rank0_result(c, p.world).sample;
  };
  ParallelDims cp2, cp4, cp2tp2;
  cp2.cp = cp2tp2.cp = 2;
  cp4.cp = 4;
  cp2tp2.tp = 2;
  Parallel hybrid{4, cp4, false, false, "cp 4 (hybrid 2 x 2)"};
  hybrid.cp_mode = "hybrid";
  hybrid.cp_ulysses = 2;
  const std::string one = sample({1, {}, false, false, "1 rank"});
  std::cout << "1 rank samples '" << one << "'\n";
  ASSERT_EQ(one.size(), 45u);
  for (const Parallel& p : {Parallel{2, cp2, false, false, "cp 2 (ring)"}, hybrid,
                            Parallel{4, cp2tp2, true, true, "cp 2 x tp 2 (SP, loss parallel)"}})
    EXPECT_EQ(sample(p), one) << p.name;
  fs::remove_all(dir);
}

// memory.checkpoint and memory.swap: recomputing the blocks, or rebuilding them from the host
// tier, changes no bit of the run, on one rank, under FSDP x TP and through pipelines: 1F1B, and
// the zero-bubble schedules, whose split backward recomputes a block in I and takes its weight
// gradients in W (20 steps, the same seed).
TEST(Trainer, ActivationCheckpointingChangesNoLoss) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_checkpointing_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ParallelDims dp2tp2, pp2, pp2dp2;
  dp2tp2.dp_shard = 2;
  dp2tp2.tp = 2;
  pp2.pp = pp2dp2.pp = 2;
  pp2dp2.dp_shard = 2;
  Parallel zbv{2, pp2, false, false, "pp 2 (ZBV)", "zbv"},
      zbh1{4, pp2dp2, false, false, "pp 2 (ZB-H1) x dp_shard 2", "zbh1"};
  zbv.layers = 4;  // a layer per stage
  for (const Parallel& p :
       {Parallel{1, {}, false, false, "1 rank"}, Parallel{4, dp2tp2, true, false, "dp_shard 2 x tp 2"},
        Parallel{2, pp2, false, false, "pp 2 (1F1B)"}, zbv, zbh1}) {
    TrainConfig c = tiny_config(dir);
    c.parallel = p.dims;
    c.sequence_parallel = p.sequence_parallel;
    c.pp_schedule = p.pp_schedule;
    c.model.as<models::LlamaConfig>().layers = p.layers;
    c.run_dir += "_" + std::to_string(p.world) + p.pp_schedule;
    const std::vector<double> plain = rank0_losses(c, p.world);
    for (const char* mode : {"full", "selective"}) {
      c.memory.checkpoint = mode;
      EXPECT_EQ(rank0_losses(c, p.world), plain) << p.name << ", memory.checkpoint " << mode;
    }
    c.memory.checkpoint = "none";
    c.memory.swap = "host";
    EXPECT_EQ(rank0_losses(c, p.world), plain) << p.name << ", memory.swap host";
    c.memory.swap = "none";
  }
  fs::remove_all(dir);
}

// Async TP (parallel.async_tp): tensor parallelism's gathers and reduce-scatters fused with its
// matmuls, alone, under FSDP and under a zero-bubble pipeline (whose W passes ask for the weights'
// gradients alone), against one rank; activation checkpointing (whose recomputation runs the fused
// ops again) changes no loss of it, bitwise.
TEST(Trainer, AsyncTensorParallelAgreesWithOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_async_tp_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ParallelDims tp2, dp2tp2, pp2tp2;
  tp2.tp = dp2tp2.tp = pp2tp2.tp = 2;
  dp2tp2.dp_shard = 2;
  pp2tp2.pp = 2;
  const auto async = [](Parallel p) {
    p.async_tp = true;
    p.name += ", async TP";
    return p;
  };
  expect_agreement(
      run_config({1, {}, false, false, "1 rank"}, dir),
      {async({2, tp2, true, true, "tp 2 (SP, LP)"}), async({4, dp2tp2, true, false, "dp_shard 2 x tp 2 (SP)"})}, dir);
  expect_agreement(run_config({1, {}, false, false, "1 rank, 4 layers", "1f1b", false, 4}, dir),
                   {async({4, pp2tp2, true, false, "pp 2 (ZBV) x tp 2 (SP)", "zbv", false, 4})}, dir);
  Parallel checkpointed = async({4, dp2tp2, true, false, "dp_shard 2 x tp 2 (SP)"});
  const std::vector<double> plain = run_config(checkpointed, dir);
  for (const char* mode : {"full", "selective"}) {
    checkpointed.checkpoint = mode;
    EXPECT_EQ(run_config(checkpointed, dir), plain) << "memory.checkpoint " << mode;
  }
  fs::remove_all(dir);
}

// QK-norms under TP: each tp rank normalizes its own heads, so the norms' weights are data-parallel
// over the tp ranks as well (hp::models::shard_over_data_and_tp: their gradients summed there).
// Losses and gradient norms (before clipping: AdamW hardly sees a gradient's scale, the norm does)
// of tp 2 and dp_shard 2 x tp 2 against one rank.
TEST(Trainer, QkNormUnderTensorParallelismMatchesOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_trainer_qk_norm_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto run = [&](int world, int64_t dp_shard, int64_t tp, bool sequence_parallel) {
    TrainConfig c = tiny_config(dir);
    c.model.as<models::LlamaConfig>().qk_norm = true;
    c.parallel.dp_shard = dp_shard;
    c.parallel.tp = tp;
    c.sequence_parallel = sequence_parallel;
    c.run_dir += "_" + std::to_string(dp_shard) + "_" + std::to_string(tp);
    return rank0_result(c, world);
  };
  const TrainResult one = run(1, 1, 1, false);
  for (const auto& [got, what] :
       {std::pair{run(2, 1, 2, true), "tp 2 (SP)"}, std::pair{run(4, 2, 2, false), "dp_shard 2 x tp 2"}}) {
    ASSERT_EQ(got.losses.size(), one.losses.size()) << what;
    double worst = 0.0;
    for (size_t i = 0; i < one.losses.size(); ++i) {
      EXPECT_NEAR(got.losses[i], one.losses[i], 1e-6 * std::abs(one.losses[i])) << what << ", step " << i + 1;
      EXPECT_NEAR(got.grad_norms[i], one.grad_norms[i], 1e-6 * std::abs(one.grad_norms[i]))
          << what << ", step " << i + 1;
      worst = std::max({worst, std::abs(got.losses[i] - one.losses[i]) / std::abs(one.losses[i]),
                        std::abs(got.grad_norms[i] - one.grad_norms[i]) / std::abs(one.grad_norms[i])});
    }
    std::cout << what << ", qk_norm: largest relative difference to 1 rank " << worst << "\n";
  }
  fs::remove_all(dir);
}

// parallel.pp_timeline_step draws that step's measured timeline: every compute action of both
// pipeline positions, once.
TEST(Trainer, DrawsTheMeasuredPipelineTimelineOfAStep) {
  const fs::path dir = test::scratch_dir("hp_trainer_timeline");
  TrainConfig c = tiny_config(dir);
  c.parallel.pp = 2;
  c.train.steps = 3;
  c.pp_timeline_step = 2;
  train_on_ranks(c, 2);
  std::ifstream in(fs::path(c.run_dir) / "pp_timeline.svg");
  ASSERT_TRUE(in.good()) << "no pp_timeline.svg in " << c.run_dir;
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(svg.find("1F1B, step 2 (measured)"), std::string::npos) << svg.substr(0, 400);
  const int64_t micro = c.micro_batches();
  for (int stage = 0; stage < 2; ++stage)
    for (int64_t mb = 0; mb < micro; ++mb)
      for (const char* kind : {"F", "B"}) {
        const std::string title = "<title>" + std::to_string(stage) + kind + std::to_string(mb) + "</title>";
        size_t count = 0;
        for (size_t at = svg.find(title); at != std::string::npos; at = svg.find(title, at + 1)) ++count;
        EXPECT_EQ(count, 1u) << title;
      }
}

}  // namespace
}  // namespace hp::train
