// train.dtype: bf16 computes forward and backward in bf16 with fp32 parameters, under every
// layout: FSDP, one rank (FSDP units of one rank), tensor and pipeline parallel without data
// parallelism, and qwen3_moe on one rank and with expert parallelism. Close to the fp32 run and not equal to it;
// bitwise the same run to run and across data-parallel degrees (deterministic mode).
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

TrainConfig small_config(const std::string& name, const std::string& dtype) {
  TrainConfig c = small_llama_config(test::scratch_dir("hp_mixed_precision_" + name));
  c.seed = 7;
  c.train.steps = 6;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.optimizer.lr = 3e-3;
  c.train.dtype = dtype;
  return c;
}

struct Layout {
  std::string name;
  int64_t dp_shard = 1, tp = 1, pp = 1, ep = 1;
  bool moe = false;  // qwen3_moe instead of llama
  int world() const { return static_cast<int>(dp_shard * tp * pp); }
};

std::vector<double> losses(const Layout& layout, const std::string& dtype) {
  TrainConfig c = small_config(layout.name + "_" + dtype, dtype);
  if (layout.moe)
    c.model = parse_config(
                  "model: {family: qwen3_moe, vocab: 256, dim: 64, layers: 2, heads: 4, kv_heads: 2, "
                  "max_seq: 32, experts: 4, top_k: 2, expert_hidden: 48}",
                  {})
                  .model;
  c.parallel.dp_shard = layout.dp_shard;
  c.parallel.tp = layout.tp;
  c.parallel.pp = layout.pp;
  c.parallel.ep = layout.ep;
  return rank0_losses(c, layout.world());
}

TEST(MixedPrecision, Bf16IsCloseToFp32InEveryLayout) {
  const std::vector<double> one_rank = losses({"one_rank"}, "bf16");
  for (const Layout& layout :
       {Layout{"one_rank"}, Layout{"dp_shard_2", 2}, Layout{"tp_2", 1, 2}, Layout{"pp_2", 1, 1, 2},
        Layout{"moe_one_rank", 1, 1, 1, 1, true}, Layout{"moe_ep_2", 2, 1, 1, 2, true}}) {
    SCOPED_TRACE(layout.name);
    // Against fp32 in the same layout, so that a layout that ignored the dtype would show.
    const std::vector<double> fp32 = losses(layout, "fp32"), bf16 = losses(layout, "bf16");
    ASSERT_EQ(bf16.size(), fp32.size());
    bool differs = false;
    for (size_t i = 0; i < fp32.size(); ++i) {
      EXPECT_NEAR(bf16[i], fp32[i], 2e-2 * fp32[i]) << "step " << i + 1;
      differs |= bf16[i] != fp32[i];
    }
    EXPECT_TRUE(differs) << "bf16 gave the fp32 losses: it did not compute in bf16";
    // Run to run, and across the data-parallel degree: the same bits.
    if (layout.tp == 1 && layout.pp == 1 && !layout.moe) {
      EXPECT_EQ(bf16, one_rank);
    }
  }
}

// Runs `losses(wire, run)` natively and on the bf16 and fp8 wires: each low-precision run follows
// the native one within 2e-2 without equalling it, and repeats bitwise.
void expect_wire_runs_follow_native(
    const std::function<std::vector<double>(const std::string&, const std::string&)>& losses) {
  const std::vector<double> native = losses("native", "");
  for (const std::string wire : {"bf16", "fp8_e4m3"}) {
    SCOPED_TRACE(wire);
    const std::vector<double> low = losses(wire, "");
    ASSERT_EQ(low.size(), native.size());
    for (size_t i = 0; i < native.size(); ++i) EXPECT_NEAR(low[i], native[i], 2e-2 * native[i]) << "step " << i + 1;
    EXPECT_NE(low, native) << "the wire format changed nothing";
    EXPECT_EQ(losses(wire, "_again"), low);
  }
}

// comm.gradient_wire: gradients reduced on a bf16 or fp8 wire (added in fp32) follow the native
// fp32 reduction closely without equalling it, and repeat bitwise run to run.
TEST(MixedPrecision, GradientsOnALowPrecisionWireFollowTheNativeReduction) {
  expect_wire_runs_follow_native([](const std::string& wire, const std::string& run) {
    TrainConfig c = small_config("wire_" + wire + run, "fp32");
    c.parallel.dp_shard = 2;
    c.comm_settings.gradient_wire = wire;
    return rank0_losses(c, 2);
  });
}

// comm.tp_wire: tensor parallelism's reductions on a bf16 or fp8 wire, with and without sequence
// parallelism, follow the native run closely without equalling it, and repeat bitwise.
TEST(MixedPrecision, TensorParallelReductionsOnALowPrecisionWireFollowTheNativeOnes) {
  for (const bool sequence_parallel : {false, true}) {
    SCOPED_TRACE(sequence_parallel ? "with sequence parallel" : "without sequence parallel");
    expect_wire_runs_follow_native([&](const std::string& wire, const std::string& run) {
      TrainConfig c = small_config("tp_wire_" + wire + run + (sequence_parallel ? "_sp" : ""), "fp32");
      c.parallel.tp = 2;
      c.sequence_parallel = sequence_parallel;
      c.comm_settings.tp_wire = wire;
      return rank0_losses(c, 2);
    });
  }
}

// The key's old name still loads (a run's config.json from before the rename).
TEST(MixedPrecision, TheOldKeyNameIsReadAsTrainDtype) {
  const std::string dir = test::scratch_dir("hp_mixed_precision_old_key");
  std::ofstream(dir + "/old.yaml") << "train:\n  mixed_precision_param: bf16\n";
  EXPECT_EQ(load_config(dir + "/old.yaml").train.dtype, "bf16");
}

TEST(MixedPrecision, BadDtypesAreRefused) {
  TrainConfig c = small_config("bad", "fp16");
  test::expect_error([&] { validate(c, 1); }, "train.dtype 'fp16' is unknown (available: fp32, bf16)");
  c.train.dtype = "bf16";
  c.train.mixed_precision_reduce = "fp8";
  test::expect_error([&] { validate(c, 1); }, "train.mixed_precision_reduce 'fp8' is unknown");
  c.train.mixed_precision_reduce = "bf16";
  test::expect_error([&] { validate(c, 1); }, "which this run does not have");
  c.parallel.dp_shard = 2;
  validate(c, 2);
  c.comm_settings.gradient_wire = "fp16";
  test::expect_error([&] { validate(c, 2); },
                     "comm.gradient_wire 'fp16' is unknown (available: native, bf16, fp8_e4m3)");
  c.comm_settings.gradient_wire = "bf16";
  validate(c, 2);
  c.parallel.dp_shard = 1;
  c.train.mixed_precision_reduce = "fp32";
  test::expect_error([&] { validate(c, 1); }, "comm.gradient_wire is the format of the gradient reduction");
  c.comm_settings.gradient_wire = "native";
  c.comm_settings.tp_wire = "bf8";
  test::expect_error([&] { validate(c, 1); }, "comm.tp_wire 'bf8' is unknown (available: native, bf16, fp8_e4m3)");
  c.comm_settings.tp_wire = "bf16";
  test::expect_error([&] { validate(c, 1); }, "comm.tp_wire is the format of tensor parallelism's reductions");
}

}  // namespace
}  // namespace hp::train
