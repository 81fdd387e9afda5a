// The config: every key known, overrides, and the documented messages for mistakes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "hp/models/llama/spec.h"
#include "hp/train/config.h"
#include "parallel/swap_tier.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/recipe_options.h"

namespace hp::train {
namespace {
using test::expect_error;

const char* kConfig = R"(
run_dir: /tmp/x
model: {dim: 64, layers: 2, heads: 4, kv_heads: 2, ffn_hidden: 128, max_seq: 32}
parallel: {dp_shard: 2, tp: 2}
data: {seq_len: 32}
train: {steps: 20, global_batch: 8, micro_batch: 2}
)";

TEST(TrainConfig, ParsesKeysAndOverrides) {
  const TrainConfig c =
      parse_config(kConfig, {"train.steps=7", "optimizer.lr=0.01", "data.sources=[a, b]", "checkpoint.dir=/ckpt"});
  EXPECT_EQ(c.checkpoint_dir(), "/ckpt");
  EXPECT_EQ(parse_config(kConfig, {}).checkpoint_dir(), "/tmp/x/checkpoints");
  EXPECT_EQ(c.model.as<models::LlamaConfig>().dim, 64);
  EXPECT_EQ(c.parallel.dp_shard, 2);
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.01);
  EXPECT_EQ(c.data.sources, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(c.micro_batches(), 2);  // 8 / dp 2 = 4 per rank, in micro-batches of 2
  validate(c, 4);
  EXPECT_NE(to_json(c).find("\"train.steps\":7"), std::string::npos);
}

// memory.swap picks the recipe's tier; the file tier's directory is memory.swap_dir, else run_dir.
TEST(TrainConfig, SwapKeysReachTheRecipe) {
  using Tier = SwapOptions::Tier;
  EXPECT_EQ(detail::recipe_options(parse_config(kConfig, {"memory.swap=host"})).swap.tier, Tier::kHost);
  const models::RecipeOptions by_default = detail::recipe_options(parse_config(kConfig, {"memory.swap=file"}));
  EXPECT_EQ(by_default.checkpoint, CheckpointMode::kSwap);
  EXPECT_EQ(by_default.swap.tier, Tier::kFile);
  EXPECT_EQ(by_default.swap.directory, "/tmp/x");
  const models::RecipeOptions named =
      detail::recipe_options(parse_config(kConfig, {"memory.swap=file", "memory.swap_dir=/scratch/swap"}));
  EXPECT_EQ(named.swap.directory, "/scratch/swap");
}

// memory.offload gives every FSDP unit one tier (made only for training, not by validation); the
// file tier's directory is memory.offload_dir, else run_dir.
TEST(TrainConfig, OffloadKeysReachTheRecipe) {
  EXPECT_EQ(detail::recipe_options_for_training(parse_config(kConfig, {})).fsdp.offload, nullptr);
  EXPECT_EQ(detail::recipe_options(parse_config(kConfig, {"memory.offload=host"})).fsdp.offload, nullptr);
  const auto host = detail::recipe_options_for_training(parse_config(kConfig, {"memory.offload=host"})).fsdp.offload;
  ASSERT_NE(host, nullptr);
  EXPECT_EQ(host->options().tier, OffloadOptions::Tier::kHost);
  const std::string dir = test::scratch_dir("offload_keys");
  if (hp::detail::on_copy_on_write_file_system(dir)) return;  // the file tier is refused there
  const auto file =
      detail::recipe_options_for_training(parse_config(kConfig, {"memory.offload=file", "memory.offload_dir=" + dir}))
          .fsdp.offload;
  ASSERT_NE(file, nullptr);
  EXPECT_EQ(file->options().tier, OffloadOptions::Tier::kFile);
  EXPECT_EQ(file->options().directory, dir);
}

// memory.offload_units and memory.offload_prefetch reach the recipe with the tier.
TEST(TrainConfig, OffloadUnitsAndPrefetchReachTheRecipe) {
  const models::RecipeOptions options = detail::recipe_options_for_training(parse_config(
      kConfig,
      {"memory.offload=host", "memory.offload_units=[root, layers.*.mlp.experts]", "memory.offload_prefetch=2"}));
  EXPECT_EQ(options.offload_units, (std::vector<std::string>{"root", "layers.*.mlp.experts"}));
  EXPECT_EQ(options.offload_prefetch, 2);
  // The tier only for the units they select.
  EXPECT_NE(options.unit_fsdp("root", options.fsdp).offload, nullptr);
  EXPECT_NE(options.unit_fsdp("layers.3.mlp.experts", options.fsdp).offload, nullptr);
  EXPECT_EQ(options.unit_fsdp("layers.3", options.fsdp).offload, nullptr);
}

// memory.blocks reach the recipe as a mode per block; memory.swap then names their tier only.
TEST(TrainConfig, BlockModesReachTheRecipe) {
  const models::RecipeOptions options =
      detail::recipe_options(parse_config(kConfig, {"memory.blocks=[swap, selective]", "memory.swap=host"}));
  EXPECT_EQ(options.checkpoint, CheckpointMode::kNone);
  EXPECT_EQ(options.block_checkpoint, (std::vector<CheckpointMode>{CheckpointMode::kSwap, CheckpointMode::kSelective}));
  EXPECT_EQ(options.swap.tier, SwapOptions::Tier::kHost);
  EXPECT_EQ(detail::recipe_options(parse_config(kConfig, {"memory.swap=host"})).checkpoint, CheckpointMode::kSwap);
  EXPECT_TRUE(detail::recipe_options(parse_config(kConfig, {})).block_checkpoint.empty());
}

// The run's config.json (to_json, its keys sorted as hp-train writes it) loads back to the same
// config, for every family: model.family is read first wherever it sorts.
TEST(TrainConfig, TheRunsConfigJsonLoadsBack) {
  for (const char* family : {"llama", "qwen3_moe"}) {
    const TrainConfig c =
        parse_config(std::string("model: {family: ") + family + ", layers: 4}\nparallel: {dp_shard: 2}", {});
    const std::string written = nlohmann::json::parse(to_json(c)).dump(1);
    EXPECT_EQ(to_json(parse_config(written, {}, "config.json")), to_json(c)) << family;
  }
}

TEST(TrainConfig, MistakesHaveTheDocumentedMessages) {
  expect_error([] { parse_config("train: {stpes: 3}", {}); }, {"unknown key 'train.stpes'", "train.steps"});
  expect_error([] { parse_config("modle: {dim: 3}", {}); }, "unknown key 'modle.dim'");
  expect_error([] { parse_config(kConfig, {"train.steps=many"}); }, "train.steps: expected an integer, got 'many'");
  expect_error([] { parse_config(kConfig, {"train.steps"}); }, "override 'train.steps' is not key=value");
  expect_error([] { parse_config("a: [", {}); }, "is not valid YAML");

  const auto invalid = [](std::vector<std::string> overrides, int world, std::string message) {
    expect_error([&] { validate(parse_config(kConfig, overrides), world); }, message);
  };
  invalid({}, 2, "parallel dims dp_replicate=1 dp_shard=2 tp=2 pp=1 multiply to 4 but the world has 2 ranks");
  invalid({"parallel.tp=4", "parallel.dp_shard=1"}, 4,
          "model.heads (4) and model.kv_heads (2) must be divisible by parallel.tp (4)");
  invalid({"model.heads=3"}, 4, "model: dim 64 is not divisible by heads 3");
  invalid({"train.global_batch=6", "parallel.dp_shard=4", "parallel.tp=1"}, 4,
          "train.global_batch (6) must be divisible by the data-parallel degree dp_replicate x dp_shard (4)");
  invalid({"train.micro_batch=3"}, 4, "train.micro_batch (3) must divide the per-rank batch global_batch / dp (4)");
  invalid({"data.seq_len=64"}, 4, "data.seq_len (64) must be in 1..model.max_seq (32)");
  invalid({"model.vocab=64"}, 4, "model.vocab (64) is smaller than the byte tokenizer's 256 tokens");
  invalid({"model.rope_theta=0"}, 4, "model: rope_theta must be a positive number, got 0");
  invalid({"model.rope_theta=.nan"}, 4, "model: rope_theta must be a positive number");
  invalid({"parallel.pp=2", "parallel.tp=1", "parallel.pp_schedule=zbv"}, 4,
          "model.layers (2) must be divisible by the 4 pipeline stages of parallel.pp_schedule zbv on 2 ranks");
  for (const char* v_shape : {"zbv", "vhalf", "vmin"})
    invalid({"parallel.pp=2", "parallel.tp=1", "model.layers=4", "model.tie_embeddings=true",
             std::string("parallel.pp_schedule=") + v_shape},
            4,
            std::string("model.tie_embeddings with parallel.pp_schedule ") + v_shape +
                " is not supported yet (its first and last stages share rank 0");
  invalid({"memory.checkpoint=some"}, 4, "memory.checkpoint 'some' is unknown (available: none, full, selective)");
  invalid({"memory.swap=disk"}, 4, "memory.swap 'disk' is unknown (available: none, host, file)");
  invalid({"memory.swap=host", "memory.swap_dir=/data/swap"}, 4,
          "memory.swap_dir is the file tier's directory; it needs memory.swap file, not host");
  invalid({"memory.swap=host", "memory.checkpoint=full"}, 4,
          "memory.swap host and memory.checkpoint full both say what blocks keep for backward; set one of them");
  invalid({"memory.swap_prefetch=-1"}, 4, "memory.swap_prefetch (-1) must be >= 0");
  invalid({"memory.blocks=[full]"}, 4,
          "memory.blocks has 1 entries for the 2 layers of the model (one per layer, in layer order)");
  invalid({"memory.blocks=[full, most]"}, 4,
          "memory.blocks: 'most' is unknown (available: none, full, selective, swap)");
  invalid({"memory.blocks=[swap, none]"}, 4, "memory.blocks: swap needs memory.swap to name its tier (host or file)");
  invalid({"memory.blocks=[full, none]", "memory.checkpoint=selective"}, 4,
          "memory.blocks and memory.checkpoint selective both say what blocks keep for backward; set one of them");
  invalid({"memory.budget_mb=-1"}, 4, "memory.budget_mb (-1) must be >= 0");
  invalid({"memory.budget_mb=100", "memory.blocks=[full, none]"}, 4,
          "memory.budget_mb chooses memory.blocks itself; leave memory.blocks and memory.checkpoint unset");
  invalid({"memory.budget_mb=100", "memory.checkpoint=full"}, 4,
          "memory.budget_mb chooses memory.blocks itself; leave memory.blocks and memory.checkpoint unset");
  invalid({"memory.offload=nvme"}, 4, "memory.offload 'nvme' is unknown (available: none, host, file)");
  invalid({"memory.offload=host", "memory.offload_dir=/data/offload"}, 4,
          "memory.offload_dir is the file tier's directory; it needs memory.offload file, not host");
  invalid({"memory.offload_units=[root]"}, 4,
          "memory.offload_units chooses the units memory.offload moves to its tier; it needs memory.offload host or "
          "file");
  invalid({"memory.offload_prefetch=2"}, 4,
          "memory.offload_prefetch is how far ahead memory.offload's units gather; it needs memory.offload host or "
          "file");
  invalid({"memory.offload=host", "memory.offload_prefetch=-1"}, 4, "memory.offload_prefetch (-1) must be >= 0");
  invalid({"memory.offload=host", "memory.offload_prefetch=0", "parallel.pp=2", "parallel.tp=1"}, 4,
          "memory.offload_prefetch orders the gathers of a model's blocks; with parallel.pp > 1 each pipeline stage "
          "is one FSDP unit that gathers at its use: leave it at 1");
  invalid({"parallel.pp=2", "parallel.tp=1", "parallel.pp_schedule=dualpipe"}, 4,
          "parallel.pp_schedule 'dualpipe' is unknown");
  invalid({"parallel.pp=2", "parallel.tp=1", "parallel.pp_layers_per_stage=[1, 1, 0]"}, 4,
          "parallel.pp_layers_per_stage has 3 entries for the 2 pipeline stages of parallel.pp_schedule 1f1b");
  invalid({"parallel.pp=2", "parallel.tp=1", "parallel.pp_layers_per_stage=[1, 2]"}, 4,
          "parallel.pp_layers_per_stage adds up to 3 layers, but model.layers is 2");
  invalid({"parallel.pp=2", "parallel.tp=1", "parallel.pp_layers_per_stage=[0, 2]"}, 4,
          "parallel.pp_layers_per_stage: every stage needs 1 to 2 layers, got 0");
  expect_error([] { parse_config(kConfig, {"parallel.pp_layers_per_stage=3"}); },
               "parallel.pp_layers_per_stage: expected a list of integers");
  expect_error([] { parse_config(kConfig, {"parallel.pp_layers_per_stage=[1, x]"}); },
               "parallel.pp_layers_per_stage: expected an integer");
  validate(parse_config(kConfig, {"parallel.pp=2", "parallel.tp=1", "parallel.pp_layers_per_stage=[1, 1]"}), 4);
  invalid({"parallel.ep=2"}, 4, "parallel.ep is for expert parallelism, which a dense llama has no use for");
  validate(parse_config(kConfig, {"parallel.cp=2"}), 8);
  invalid({"parallel.cp=2", "parallel.cp_mode=zigzag"}, 8,
          "parallel.cp_mode 'zigzag' is unknown (available: ring, allgather, ulysses, hybrid)");
  invalid({"parallel.cp=2", "data.seq_len=30"}, 8, "data.seq_len (30) must be divisible by 2 x parallel.cp (4)");
  invalid({"parallel.cp_mode=ulysses"}, 4,
          "parallel.cp_mode, parallel.cp_ulysses and parallel.cp_async need parallel.cp > 1");
  invalid({"parallel.cp_async=true"}, 4,
          "parallel.cp_mode, parallel.cp_ulysses and parallel.cp_async need parallel.cp > 1");
  invalid({"parallel.cp=2", "parallel.cp_ulysses=2"}, 8,
          "parallel.cp_ulysses is the Ulysses degree of parallel.cp_mode hybrid; parallel.cp_mode is ring");
  validate(parse_config(kConfig, {"parallel.cp=2", "sample.tokens=5"}), 8);
  invalid({"parallel.cp=2", "sample.tokens=5", "model.max_seq=34", "data.seq_len=24"}, 8,
          "sample.tokens under parallel.cp needs model.max_seq (34) divisible by 2 x parallel.cp (4)");
  validate(parse_config(kConfig, {"data.seq_len=31"}), 4);  // odd lengths are fine without cp
  invalid({"parallel.cp=2", "parallel.sequence_parallel=true", "data.seq_len=12", "parallel.tp=4",
           "parallel.dp_shard=1", "model.heads=8", "model.kv_heads=4"},
          8, "data.seq_len (12) / parallel.cp (2) must be divisible by parallel.tp (4) with sequence_parallel");
  validate(parse_config(kConfig, {"parallel.cp=2", "parallel.dp_shard=1", "parallel.reshard_after_forward_to=2"}), 4);
  invalid({"parallel.cp=4", "parallel.cp_mode=ulysses"}, 16,
          "2 query heads (on this rank) do not divide by the Ulysses degree 4");
  invalid({"parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_ulysses=4"}, 16,
          "the Ulysses degree 4 must be above 1, below cp and divide cp (4)");
  validate(parse_config(kConfig, {"parallel.cp=2", "parallel.dp_replicate=2"}), 16);
  invalid({"parallel.reshard_after_forward_to=3"}, 4,
          "parallel.reshard_after_forward_to (3) must divide parallel.dp_shard (2)");
  invalid({"parallel.pp_timeline_step=2"}, 4, "parallel.pp_timeline_step needs parallel.pp > 1");
  for (const char* costs : {"1,2", "1,2,0", "1,2,0.5,-1", "fast", "1;2;3", "1,2,3,4,5"})
    invalid({"parallel.pp=2", "parallel.tp=1", "parallel.pp_schedule=zbh1", std::string("parallel.pp_costs=") + costs},
            4,
            std::string("parallel.pp_costs '") + costs +
                "' is not measured, unit, or positive relative costs F,I,W or F,I,W,send (e.g. 1,1.2,0.7)");
  invalid({"parallel.pp=2", "parallel.tp=1", "parallel.pp_costs=unit"}, 4,
          "parallel.pp_costs (unit) orders the zero-bubble schedules (zbv, zbh1, zbh2, vhalf, vmin) of parallel.pp > "
          "1; this "
          "run has "
          "parallel.pp 2 and parallel.pp_schedule 1f1b");
  validate(parse_config(kConfig, {"parallel.pp=2", "parallel.tp=1", "parallel.pp_schedule=zbh2",
                                  "parallel.pp_costs=1,1.2,0.7,0.1"}),
           4);
  invalid({"parallel.pp=2", "parallel.tp=1", "parallel.pp_timeline_step=21"}, 4,
          "parallel.pp_timeline_step (21) must be a step of the run, 1 to train.steps (20), or 0 for none");
  invalid({"resilience.collective_timeout_s=60", "resilience.watchdog_s=62"}, 4,
          "resilience.watchdog_s 62 is too short for resilience.collective_timeout_s 60: the timeouts must nest, "
          "collective_timeout_s + 2 s (naming the missing ranks) < watchdog_s");
  validate(parse_config(kConfig, {"resilience.collective_timeout_s=60", "resilience.watchdog_s=63"}), 4);
  invalid({"resilience.collective_timeout_s=0"}, 4, "resilience.collective_timeout_s must be > 0");
  invalid({"optimizer.name=sgd"}, 4, "optimizer.name 'sgd' is unknown (available: adamw, muon)");
  invalid({"schedule.decay=step"}, 4, "step");
  invalid({"schedule.warmup_steps=30"}, 4, "schedule.warmup_steps (30) must be in 0..train.steps (20)");
  invalid({"parallel.sequence_parallel=true", "parallel.tp=1", "parallel.dp_shard=4"}, 4,
          "parallel.sequence_parallel needs parallel.tp > 1");
  invalid({"parallel.async_tp=true"}, 4, "parallel.async_tp fuses sequence parallelism's gathers");
  invalid({"parallel.async_tp=true", "parallel.sequence_parallel=true", "comm.tp_wire=bf16"}, 4,
          "parallel.async_tp is not combined with comm.tp_wire");
  invalid({"parallel.async_tp=true", "parallel.sequence_parallel=true", "comm.transport=gloo"}, 4,
          "which comm.transport: gloo turns off");
  // Huge values are errors, not wrapped arithmetic or giant allocations.
  invalid({"parallel.dp_shard=4611686018427387904", "parallel.tp=4"}, 4, "multiply beyond 64 bits");
  invalid({"model.dim=4294967296", "model.heads=1", "model.kv_heads=1"}, 4, "the parameter count would overflow");
  invalid({"model.vocab=-5"}, 4, "must be positive");
  expect_error([] { parse_config(kConfig, {"train.steps=99999999999999999999"}); }, "train.steps: expected an integer");
}

}  // namespace
}  // namespace hp::train
