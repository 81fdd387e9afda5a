// The qwen3_moe family: the published shapes on meta, its model.* keys, and hp-train on 4 ranks
// with expert parallelism borrowed from dp_shard against expert-data sharding alone and one rank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "hp/models/model_spec.h"
#include "hp/models/qwen3_moe/model.h"
#include "hp/testing/run_ranks.h"
#include "hp/train/trainer.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;
using models::Qwen3MoeConfig;

// The model built on meta (parameters without storage) holds config.parameter_count() parameters,
// and the total and active counts are within 2% of the published ones (which are rounded: our
// 30B-A3B runs 3.35B per token, the router included, against the published "3.3B").
void expect_published(Qwen3MoeConfig c, double total, double active) {
  c.llama.max_seq = 128;  // the rotary tables, not parameters: keep them small
  const auto model = models::make_qwen3_moe(c);
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  EXPECT_EQ(numel, c.parameter_count());
  EXPECT_NEAR(static_cast<double>(c.parameter_count()), total, 0.02 * total);
  EXPECT_NEAR(static_cast<double>(c.active_parameter_count()), active, 0.02 * active);
}

TEST(Qwen3Moe, PublishedShapesHaveThePublishedParameterCounts) {
  expect_published(models::qwen3_30b_a3b(), 30.5e9, 3.3e9);  // "30.5B in total and 3.3B activated"
  expect_published(models::qwen3_235b_a22b(), 235e9, 22e9);  // "235B in total and 22B activated"
}

const std::string kBatch = "train: {global_batch: 8, micro_batch: 2}";

TEST(Qwen3Moe, ItsKeysParseAndItsRecipeChecksTheDims) {
  const TrainConfig c = parse_config(
      "model: {family: qwen3_moe, experts: 4, top_k: 1, head_dim: 16}\n"
      "parallel: {dp_shard: 4, ep: 2}\n" +
          kBatch,
      {"model.expert_hidden=96"});
  EXPECT_EQ(c.model->family(), "qwen3_moe");
  EXPECT_EQ(c.model.as<Qwen3MoeConfig>().experts, 4);
  EXPECT_EQ(c.model.as<Qwen3MoeConfig>().expert_hidden, 96);
  EXPECT_EQ(c.model.as<Qwen3MoeConfig>().llama.head_size(), 16);
  EXPECT_TRUE(c.model.as<Qwen3MoeConfig>().llama.qk_norm);
  validate(c, 4);
  test::expect_error([] { parse_config("model: {family: qwen3_moe, ffn_hidden: 64}", {}); },
                     {"unknown key 'model.ffn_hidden'", "model.expert_hidden"});
  test::expect_error([] { validate(parse_config("model: {family: qwen3_moe, top_k: 9}", {}), 1); },
                     "model: top_k (9) must be between 1 and experts (8)");
  test::expect_error(
      [&] {
        validate(parse_config("model: {family: qwen3_moe, experts: 6}\nparallel: {dp_shard: 4, ep: 4}\n" + kBatch, {}),
                 4);
      },
      "model.experts (6) must be divisible by parallel.ep (4)");
  test::expect_error(
      [&] { validate(parse_config("model: {family: qwen3_moe}\nparallel: {dp_shard: 2, tp: 2}\n" + kBatch, {}), 4); },
      "the qwen3_moe recipe does not support parallel.tp, parallel.cp or parallel.pp yet");
}

struct Layout {
  int64_t dp_replicate = 1, dp_shard = 1, ep = 1;
  int world() const { return static_cast<int>(dp_replicate * dp_shard); }
};

TrainConfig qwen3_moe_config(const Layout& layout, int64_t experts, const fs::path& dir) {
  TrainConfig c = parse_config(
      "model: {family: qwen3_moe, vocab: 256, dim: 32, layers: 2, heads: 4, kv_heads: 2, "
      "max_seq: 32, top_k: 2, expert_hidden: 48}",
      {});
  c.model.as<Qwen3MoeConfig>().experts = experts;
  c.run_dir = (dir / ("run_" + std::to_string(layout.dp_replicate) + "_" + std::to_string(layout.dp_shard) + "_" +
                      std::to_string(layout.ep) + "_" + std::to_string(experts)))
                  .string();
  c.seed = 11;
  c.parallel.dp_replicate = layout.dp_replicate;
  c.parallel.dp_shard = layout.dp_shard;
  c.parallel.ep = layout.ep;
  c.data.sources = {write_corpus(dir / "text")};
  c.data.cache_dir = (dir / "cache").string();
  c.data.seq_len = 32;
  c.train.steps = 20;
  c.train.global_batch = 8;
  c.train.micro_batch = 2;
  c.optimizer.lr = 3e-3;
  c.eval.batches = 1;
  validate(c, layout.world());
  return c;
}

TrainResult train_qwen3_moe(const Layout& layout, int64_t experts, const fs::path& dir) {
  return rank0_result(qwen3_moe_config(layout, experts, dir), layout.world());
}

// Per-step losses and gradient norms (before clipping; AdamW's steps hardly depend on a gradient's
// scale, its norm does) within `tolerance`, relative.
void expect_near(const TrainResult& got, const TrainResult& want, double tolerance, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  ASSERT_EQ(got.grad_norms.size(), want.grad_norms.size()) << what;
  double largest = 0.0;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    for (auto [g, w, name] : {std::tuple{got.losses[i], want.losses[i], "loss"},
                              std::tuple{got.grad_norms[i], want.grad_norms[i], "gradient norm"}}) {
      EXPECT_NEAR(g, w, tolerance * std::abs(w)) << what << ", step " << i + 1 << " " << name;
      largest = std::max(largest, std::abs(g - w) / std::abs(w));
    }
  }
  std::cout << what << ": largest relative difference " << largest << "\n";
}

// ep 2 and ep 4 borrowed from dp_shard 4, ep 2 under HSDP (2 x 2), and one rank, against dp_shard 4
// with the experts only FSDP-sharded: the same per-step losses and gradient norms within 1e-6 (the
// experts' GEMMs see the same rows in other batch sizes, so the last bits may differ).
TEST(Qwen3Moe, HpTrainWithExpertParallelismMatchesShardingTheExpertsOnly) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const TrainResult ep1 = train_qwen3_moe({1, 4, 1}, 4, dir);
  ASSERT_EQ(ep1.losses.size(), 20u);
  EXPECT_LT(ep1.losses.back(), ep1.losses.front() - 1.0) << "the loss should fall";
  expect_near(train_qwen3_moe({1, 4, 2}, 4, dir), ep1, 1e-6, "ep 2 of dp_shard 4");
  expect_near(train_qwen3_moe({1, 4, 4}, 4, dir), ep1, 1e-6, "ep 4 of dp_shard 4");
  expect_near(train_qwen3_moe({2, 2, 2}, 4, dir), ep1, 1e-6, "ep 2 of dp_shard 2 under dp_replicate 2");
  expect_near(train_qwen3_moe({1, 1, 1}, 4, dir), ep1, 1e-6, "one rank");
  fs::remove_all(dir);
}

// Fewer local experts than expert-data ranks: the experts' FSDP splits dim 1 instead of the experts
// (and the blocks' FSDP splits the routers' columns: 2 rows for 4 ranks).
TEST(Qwen3Moe, ExpertsFewerThanTheirShardRanksSplitTheHiddenDim) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_dim1_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const TrainResult one = train_qwen3_moe({1, 1, 1}, 2, dir);
  expect_near(train_qwen3_moe({1, 4, 1}, 2, dir), one, 1e-6, "2 experts over dp_shard 4");
  expect_near(train_qwen3_moe({1, 4, 2}, 2, dir), one, 1e-6, "1 local expert over efsdp 2");
  fs::remove_all(dir);
}

// The auxiliary losses in hp-train: ep 2 of dp_shard 4 and one rank with two micro-batches train
// alike with them (losses and gradient norms within 1e-6 of ep 1), and metrics.jsonl reports them.
TEST(Qwen3Moe, AuxiliaryLossesTrainAlikeUnderExpertParallelism) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_aux_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto with_aux = [&](const Layout& layout) {
    TrainConfig c = qwen3_moe_config(layout, 4, dir);
    auto& m = c.model.as<Qwen3MoeConfig>();
    m.aux_loss_coeff = 0.01;
    m.seq_aux_loss_coeff = 0.01;
    m.z_loss_coeff = 0.001;
    c.run_dir += "_aux";
    return c;
  };
  const TrainConfig reference = with_aux({1, 4, 1});
  const TrainResult ep1 = rank0_result(reference, 4);
  expect_near(rank0_result(with_aux({1, 4, 2}), 4), ep1, 1e-6, "aux losses, ep 2 of dp_shard 4");
  TrainConfig one = with_aux({1, 1, 1});  // 8 rows in 4 micro-batches of 2
  expect_near(rank0_result(one, 1), ep1, 1e-6, "aux losses, one rank");
  // Without them the gradients differ: the losses reach the router.
  EXPECT_NE(train_qwen3_moe({1, 4, 1}, 4, dir).grad_norms[0], ep1.grad_norms[0]);
  double aux = 0.0;
  std::ifstream metrics(reference.run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.at("kind") == "train") aux = j.at("moe.layers.1.aux_loss").get<double>();
  }
  EXPECT_GT(aux, 0.0);
  fs::remove_all(dir);
}

// Capacity in hp-train (ep 2 of dp_shard 4, 4 experts, capacity_factor 1: each expert takes at
// most a quarter of a rank's micro-batch rows): drop_lowest trains and reports the dropped rows per
// layer in metrics.jsonl; the error policy stops the run with the rank and expert named.
TEST(Qwen3Moe, CapacityDropsOrStopsInHpTrain) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_capacity_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  TrainConfig c = qwen3_moe_config({1, 4, 2}, 4, dir);
  c.model.as<Qwen3MoeConfig>().capacity_factor = 1.0;
  c.model.as<Qwen3MoeConfig>().capacity_policy = "drop_lowest";
  const TrainResult r = rank0_result(c, 4);
  ASSERT_EQ(r.losses.size(), 20u);
  for (double loss : r.losses) EXPECT_TRUE(std::isfinite(loss));
  double dropped = 0.0;
  std::ifstream metrics(c.run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.at("kind") == "train") dropped += j.at("moe.layers.0.dropped").get<double>();
  }
  EXPECT_GT(dropped, 0.0) << "an untrained router is not balanced enough to fit a capacity of 1";
  std::cout << "layer 0 dropped " << dropped << " rows over 20 steps\n";

  c.model.as<Qwen3MoeConfig>().capacity_policy = "error";
  c.run_dir += "_error";
  test::expect_error(
      [&] {
        testing::run_ranks(4, [&](const comm::ProcessGroup& group) {
          TrainOptions options;
          options.progress = false;
          train(c, group, options);
        });
      },
      {"MoE: rank ", "rows, over its capacity of 32"});
  test::expect_error(
      [&] { parse_config("model: {family: qwen3_moe, capacity_policy: drop_first}", {}).model->validate(); },
      "capacity_policy 'drop_first' is unknown");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hp::train
