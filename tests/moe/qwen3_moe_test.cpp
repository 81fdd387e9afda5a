// The qwen3_moe family: the published shapes on meta, its model.* keys, and hp-train on 4 ranks
// with expert parallelism borrowed from dp_shard against expert-data sharding alone and one rank.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "hp/dcp/hf.h"
#include "hp/dcp/state_dict.h"
#include "hp/models/hf_config.h"
#include "hp/models/hf_state.h"
#include "hp/models/model_spec.h"
#include "hp/models/qwen3_moe/model.h"
#include "hp/nn/init.h"
#include "hp/parallel/expert_parallel.h"
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

// The model's tensors as Qwen3MoeForCausalLM's (each layer's stacked experts split per expert,
// the router as mlp.gate), written as Hugging Face files and read back: every tensor bitwise,
// the expert bias included.
TEST(Qwen3Moe, HuggingFaceExportAndImportRoundTripBitwise) {
  Qwen3MoeConfig c;
  c.llama.layers = 2;
  c.experts = 4;
  c.load_balance_rate = 0.001;  // gives the routers their expert bias
  const auto model = models::make_qwen3_moe(c);
  nn::init_parameters(*model, 5);
  dcp::StateDict ours = dcp::model_state_dict(*model, "");
  at::Tensor& bias = ours.tensors.at("layers.1.mlp.router.expert_bias");
  bias.copy_(at::arange(bias.numel(), bias.options()) * 0.3 - 0.4);
  dcp::StateDict hf;
  hf.tensors = models::to_hf_tensors(ours.tensors);
  const int64_t dim = c.llama.dim, hidden = c.expert_hidden;
  const std::map<std::string, std::pair<std::vector<int64_t>, at::Tensor>> expected = {
      {"model.layers.1.mlp.gate.weight", {{4, dim}, ours.tensors.at("layers.1.mlp.router.gate.weight")}},
      {"model.layers.1.mlp.gate.e_score_correction_bias", {{4}, bias}},
      {"model.layers.1.mlp.experts.3.gate_proj.weight", {{hidden, dim}, ours.tensors.at("layers.1.mlp.experts.w1")[3]}},
      {"model.layers.1.mlp.experts.3.up_proj.weight", {{hidden, dim}, ours.tensors.at("layers.1.mlp.experts.w3")[3]}},
      {"model.layers.0.mlp.experts.2.down_proj.weight", {{dim, hidden}, ours.tensors.at("layers.0.mlp.experts.w2")[2]}},
      {"model.layers.0.self_attn.q_norm.weight",
       {{c.llama.head_size()}, ours.tensors.at("layers.0.attn.q_norm.weight")}}};
  for (const auto& [name, want] : expected) {
    ASSERT_TRUE(hf.tensors.count(name)) << name;
    EXPECT_EQ(hf.tensors.at(name).sizes().vec(), want.first) << name;
    EXPECT_TRUE(at::equal(hf.tensors.at(name), want.second)) << name;
  }
  // Per layer: 4 attention weights, 2 QK norms, 2 norms, the gate, the bias, 3 x 4 experts.
  EXPECT_EQ(hf.tensors.size(), 3u + 2u * (8u + 2u + 12u));

  const std::string dir = test::scratch_dir("qwen3_moe_hf");
  test::run(1, [&](const comm::ProcessGroup& world) {
    dcp::save_hf(hf, dir, world, [](const std::string& name) { return name; });
  });
  const models::NamedTensors back = models::from_hf_tensors(dcp::load_hf_whole(dir).tensors);
  ASSERT_EQ(back.size(), ours.tensors.size());
  for (const auto& [name, t] : ours.tensors) {
    ASSERT_TRUE(back.count(name)) << name;
    EXPECT_TRUE(at::equal(back.at(name), t)) << name;
  }

  models::NamedTensors gap = hf.tensors;
  gap.erase("model.layers.0.mlp.experts.1.up_proj.weight");
  test::expect_error([&] { models::from_hf_tensors(gap); }, "'layers.0.mlp.experts.w3' lacks expert 1");
  models::NamedTensors stranger = ours.tensors;
  stranger["layers.0.mlp.shared.w1.weight"] = at::zeros({2, 2});
  test::expect_error([&] { models::to_hf_tensors(stranger); },
                     "'layers.0.mlp.shared.w1.weight' has no Hugging Face name");
}

// config.json both ways: our Qwen3-30B-A3B shape gives the published config.json's architecture
// keys, and those keys give back the same model (and a dense Qwen3 and a Llama theirs); a config
// we cannot build is refused by name.
TEST(Qwen3Moe, HuggingFaceConfigBothWays) {
  TrainConfig moe = parse_config("model: {family: qwen3_moe}", {});
  moe.model.as<Qwen3MoeConfig>() = models::qwen3_30b_a3b();
  const auto hf = nlohmann::json::parse(models::to_hf_config(*moe.model));
  // From Qwen/Qwen3-30B-A3B's config.json.
  const auto published = nlohmann::json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": false,
    "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": null,
    "rope_theta": 1000000.0, "tie_word_embeddings": false, "vocab_size": 151936})");
  for (const auto& [key, value] : published.items()) EXPECT_EQ(hf.at(key), value) << key;
  for (TrainConfig c : {moe, parse_config("model: {family: llama, qk_norm: true, tie_embeddings: true}", {}),
                        parse_config("model: {family: llama, head_dim: 16, rope_theta: 500000.0}", {})}) {
    const std::string config_json = models::to_hf_config(*c.model);
    const TrainConfig back = parse_config(models::model_keys_from_hf_config(config_json), {});
    EXPECT_EQ(back.model->family(), c.model->family());
    EXPECT_EQ(models::to_hf_config(*back.model), config_json);
  }
  const auto refused = [&](const char* change, const std::string& message) {
    nlohmann::json j = hf;
    j.merge_patch(nlohmann::json::parse(change));
    test::expect_error([&] { models::model_keys_from_hf_config(j.dump()); }, message);
  };
  refused(R"({"model_type": "mixtral"})", "model_type 'mixtral' is not one we build");
  refused(R"({"rope_scaling": {"type": "yarn", "factor": 4.0}})", "rope_scaling is set");
  refused(R"({"mlp_only_layers": [0]})", "some layers are dense");
  refused(R"({"hidden_size": null})", "config.json lacks the integer 'hidden_size'");
  refused(R"({"hidden_act": 5})", "config.json's 'hidden_act' has the wrong type (number)");
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
  // tp without sequence parallelism, and auxiliary losses under tp, are accepted.
  validate(
      parse_config("model: {family: qwen3_moe, z_loss_coeff: 0.001}\nparallel: {dp_shard: 2, tp: 2}\n" + kBatch, {}),
      4);
  // cp, with ep borrowed from it.
  validate(parse_config("model: {family: qwen3_moe, experts: 4}\nparallel: {dp_shard: 2, cp: 2, ep: 4}\n" + kBatch, {}),
           4);
}

struct Layout {
  int64_t dp_replicate = 1, dp_shard = 1, ep = 1, pp = 1;
  std::string pp_schedule = "1f1b";
  int64_t layers = 2, tp = 1;
  bool sequence_parallel = true;  // with tp > 1
  int64_t cp = 1;
  std::string cp_mode = "ring";  // with cp > 1
  int world() const { return static_cast<int>(pp * dp_replicate * dp_shard * cp * tp); }
  std::string name() const {
    std::string n;
    for (int64_t v : {dp_replicate, dp_shard, ep, pp, layers, tp, cp}) n += "_" + std::to_string(v);
    return n + (pp > 1 ? "_" + pp_schedule : "") + (tp > 1 && !sequence_parallel ? "_nosp" : "") +
           (cp > 1 ? "_" + cp_mode : "");
  }
};

TrainConfig qwen3_moe_config(const Layout& layout, int64_t experts, const fs::path& dir) {
  TrainConfig c = parse_config(
      "model: {family: qwen3_moe, vocab: 256, dim: 32, heads: 4, kv_heads: 2, "
      "max_seq: 32, top_k: 2, expert_hidden: 48}",
      {});
  c.model.as<Qwen3MoeConfig>().experts = experts;
  c.model.as<Qwen3MoeConfig>().llama.layers = layout.layers;
  c.run_dir = (dir / ("run" + layout.name() + "_" + std::to_string(experts))).string();
  c.seed = 11;
  c.parallel.dp_replicate = layout.dp_replicate;
  c.parallel.dp_shard = layout.dp_shard;
  c.parallel.ep = layout.ep;
  c.parallel.pp = layout.pp;
  c.parallel.tp = layout.tp;
  c.parallel.cp = layout.cp;
  if (layout.cp > 1) c.cp_mode = layout.cp_mode;
  c.sequence_parallel = layout.tp > 1 && layout.sequence_parallel;
  c.pp_schedule = layout.pp_schedule;
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

// The last train line's metrics of each layer whose name ends in `suffix`, from metrics.jsonl.
std::map<std::string, double> last_moe_metrics(const std::string& run_dir, const std::string& suffix) {
  std::map<std::string, double> found;
  std::ifstream metrics(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.at("kind") != "train") continue;
    for (const auto& [key, value] : j.items())
      if (key.rfind("moe.", 0) == 0 && key.size() > suffix.size() &&
          key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0)
        found[key] = value.get<double>();
  }
  return found;
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

// 4-layer runs with the routers' bias balancing on, each layout against dp_shard 4 with ep 1: the
// same per-step losses and gradient norms within 1e-6, and rank 0's max_load of every layer equal
// (rank 0 reports every layer, those of pipeline stages it does not run included).
void expect_balanced_runs_match(const std::string& name, const std::vector<std::pair<Layout, std::string>>& layouts) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto balanced = [&](Layout layout) {
    layout.layers = 4;
    TrainConfig c = qwen3_moe_config(layout, 4, dir);
    c.model.as<Qwen3MoeConfig>().load_balance_rate = 0.01;
    return c;
  };
  const TrainConfig reference = balanced({1, 4, 1});
  const TrainResult want = rank0_result(reference, 4);
  for (const auto& [layout, what] : layouts) {
    const TrainConfig c = balanced(layout);
    expect_near(rank0_result(c, layout.world()), want, 1e-6, what);
    EXPECT_EQ(last_moe_metrics(c.run_dir, ".max_load"), last_moe_metrics(reference.run_dir, ".max_load")) << what;
  }
  fs::remove_all(dir);
}

// Pipelines: ep 2 of dp_shard 2 at each of 2 pipeline positions, under 1F1B, interleaved 1F1B and
// ZBV (4 stages of one layer: W split from I through the experts' all_to_alls); each stage's
// counts are summed over its data-parallel ranks.
TEST(Qwen3Moe, HpTrainWithExpertParallelismThroughPipelinesMatches) {
  std::vector<std::pair<Layout, std::string>> layouts;
  for (const char* schedule : {"1f1b", "interleaved", "zbv"})
    layouts.push_back({Layout{1, 2, 2, 2, schedule}, std::string("ep 2 of dp_shard 2 x pp 2 (") + schedule + ")"});
  expect_balanced_runs_match("pp", layouts);
}

// Tensor parallelism: each tp rank runs the MoE on its sequence shard (as sequence parallelism
// hands it, or cut from the replicated stream without it), ep borrowed from the tp ranks (ep 2 of
// dp_shard 2 x tp 2), from tp and dp_shard (ep 4), or not at all (ep 1: the experts FSDP-sharded
// over dp_shard x tp).
TEST(Qwen3Moe, HpTrainWithTensorParallelismSplitsTheTokens) {
  Layout tp_ep2{1, 2, 2}, tp_ep4{1, 2, 4}, tp_ep1{1, 2, 1};
  for (Layout* l : {&tp_ep2, &tp_ep4, &tp_ep1}) l->tp = 2;
  expect_balanced_runs_match("tp", {{tp_ep2, "ep 2 of dp_shard 2 x tp 2"},
                                    {tp_ep4, "ep 4 of dp_shard 2 x tp 2"},
                                    {tp_ep1, "ep 1, dp_shard 2 x tp 2"}});
}

// The same through a pipeline (ep 2 of tp 2 x pp 2) and without sequence parallelism.
TEST(Qwen3Moe, HpTrainWithTensorParallelismThroughAPipelineOrWithoutSequenceParallelism) {
  Layout tp_pp{1, 1, 2, 2}, no_sp{1, 2, 2};
  tp_pp.tp = no_sp.tp = 2;
  no_sp.sequence_parallel = false;
  expect_balanced_runs_match("tp_pp", {{tp_pp, "ep 2 of tp 2 x pp 2 (1F1B)"},
                                       {no_sp, "ep 2 of dp_shard 2 x tp 2 without sequence parallelism"}});
}

// Fewer local experts than expert-data ranks: the experts' FSDP splits dim 1 instead of the experts
// (and the blocks' FSDP splits the routers' columns: 2 rows for 4 ranks, over dp_shard or over
// dp_shard x cp).
TEST(Qwen3Moe, ExpertsFewerThanTheirShardRanksSplitTheHiddenDim) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_dim1_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const TrainResult one = train_qwen3_moe({1, 1, 1}, 2, dir);
  expect_near(train_qwen3_moe({1, 4, 1}, 2, dir), one, 1e-6, "2 experts over dp_shard 4");
  expect_near(train_qwen3_moe({1, 4, 2}, 2, dir), one, 1e-6, "1 local expert over efsdp 2");
  Layout cp{1, 2, 1};  // the blocks' units shard over dp_shard x cp: 4 ranks for the routers' 2 rows
  cp.cp = 2;
  expect_near(train_qwen3_moe(cp, 2, dir), one, 1e-6, "2 experts over dp_shard 2 x cp 2");
  fs::remove_all(dir);
}

// `layout`'s run of 4 experts with every auxiliary loss on.
TrainConfig with_aux_losses(const Layout& layout, const fs::path& dir) {
  TrainConfig c = qwen3_moe_config(layout, 4, dir);
  auto& m = c.model.as<Qwen3MoeConfig>();
  m.aux_loss_coeff = 0.01;
  m.seq_aux_loss_coeff = 0.01;
  m.z_loss_coeff = 0.001;
  c.run_dir += "_aux";
  return c;
}

// The auxiliary losses in hp-train: ep 2 of dp_shard 4, ep 2 of dp_shard 2 x tp 2 (with and
// without sequence parallelism) and one rank with four micro-batches train alike with them (losses
// and gradient norms within 1e-6 of ep 1), and metrics.jsonl reports them.
TEST(Qwen3Moe, AuxiliaryLossesTrainAlikeUnderExpertParallelism) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_aux_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const TrainConfig reference = with_aux_losses({1, 4, 1}, dir);
  const TrainResult ep1 = rank0_result(reference, 4);
  expect_near(rank0_result(with_aux_losses({1, 4, 2}, dir), 4), ep1, 1e-6, "aux losses, ep 2 of dp_shard 4");
  // Under tp each rank sees a shard of every sequence: the statistics are summed over tp.
  Layout tp{1, 2, 2}, no_sp{1, 2, 2};
  tp.tp = no_sp.tp = 2;
  no_sp.sequence_parallel = false;
  expect_near(rank0_result(with_aux_losses(tp, dir), 4), ep1, 1e-6, "aux losses, ep 2 of dp_shard 2 x tp 2");
  expect_near(rank0_result(with_aux_losses(no_sp, dir), 4), ep1, 1e-6,
              "aux losses, the same without sequence parallelism");
  TrainConfig one = with_aux_losses({1, 1, 1}, dir);  // 8 rows in 4 micro-batches of 2
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

// Context parallelism: each cp rank runs the MoE on its head-tail share of every sequence's
// positions. Against dp_shard 4 with ep 1, with the routers' bias balancing on (per-step losses and
// gradient norms within 1e-6, and rank 0's loads of every layer equal): cp 2 alone (the experts
// FSDP-sharded over the cp ranks) and ep 2 borrowed from cp 2 x dp_shard 2.
TEST(Qwen3Moe, HpTrainWithContextParallelismMatches) {
  Layout cp2{1, 1, 1}, cp_dp{1, 2, 2};
  cp2.cp = cp_dp.cp = 2;
  expect_balanced_runs_match("cp", {{cp2, "cp 2, ep 1"}, {cp_dp, "ep 2 of cp 2 (ring) x dp_shard 2"}});
}

// The same with Ulysses (ep 2 of cp 2 x dp_shard 2) and with ep 4 borrowed from cp 4 alone.
TEST(Qwen3Moe, HpTrainWithUlyssesOrFourContextRanksMatches) {
  Layout ulysses{1, 2, 2}, cp4{1, 1, 4};
  ulysses.cp = 2;
  ulysses.cp_mode = "ulysses";
  cp4.cp = 4;
  expect_balanced_runs_match("cp_ulysses",
                             {{ulysses, "ep 2 of cp 2 (ulysses) x dp_shard 2"}, {cp4, "ep 4 of cp 4 (ring)"}});
}

// The same composed with the other dims: ep 4 from cp 2 x tp 2, ep 2 of cp 2 x pp 2 (1F1B), and
// ep 2 of cp 2 under dp_replicate 2 (HSDP).
TEST(Qwen3Moe, HpTrainWithContextParallelismComposedMatches) {
  Layout cp_tp{1, 1, 4}, cp_pp{1, 1, 2, 2}, cp_hsdp{2, 1, 2};
  cp_tp.cp = cp_pp.cp = cp_hsdp.cp = 2;
  cp_tp.tp = 2;
  expect_balanced_runs_match("cp_dims", {{cp_tp, "ep 4 of cp 2 (ring) x tp 2"},
                                         {cp_pp, "ep 2 of cp 2 (ring) x pp 2 (1F1B)"},
                                         {cp_hsdp, "ep 2 of cp 2 (ring) under dp_replicate 2"}});
}

// The auxiliary losses under context parallelism, whose statistics the cp ranks sum (sequences the
// cp ranks share count once): cp 2 x dp_shard 2 and cp 2 x tp 2 with ep 2, within 1e-6 of
// dp_shard 4.
TEST(Qwen3Moe, AuxiliaryLossesTrainAlikeUnderContextParallelism) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_cp_aux_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const TrainResult want = rank0_result(with_aux_losses({1, 4, 1}, dir), 4);
  Layout aux_dp{1, 2, 2}, aux_tp{1, 1, 2};
  aux_dp.cp = aux_tp.cp = aux_tp.tp = 2;
  expect_near(rank0_result(with_aux_losses(aux_dp, dir), 4), want, 1e-6, "aux losses, ep 2 of cp 2 x dp_shard 2");
  expect_near(rank0_result(with_aux_losses(aux_tp, dir), 4), want, 1e-6, "aux losses, ep 2 of cp 2 x tp 2");
  fs::remove_all(dir);
}

// Residual and attention dropout at 0.1 (the llama Block and recipe the family shares): each rank
// draws its part of one rank's masks, so routing sees the same activations and ep 2 of dp_shard 2
// x tp 2 (SP), of cp 2 (ring) x dp_shard 2 and of dp_shard 2 x pp 2 (1F1B) train one rank's curve:
// losses and gradient norms within 1e-6 at each of 20 steps.
TEST(Qwen3Moe, DropoutAgreesWithOneRank) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_dropout_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto with_dropout = [&](const Layout& layout) {
    TrainConfig c = qwen3_moe_config(layout, 4, dir);
    c.model.as<Qwen3MoeConfig>().llama.residual_dropout = 0.1;
    c.model.as<Qwen3MoeConfig>().llama.attention_dropout = 0.1;
    c.run_dir += "_dropout";
    return c;
  };
  const TrainResult want = rank0_result(with_dropout({1, 1, 1}), 1);
  const TrainResult without = rank0_result(qwen3_moe_config({1, 1, 1}, 4, dir), 1);
  ASSERT_EQ(want.losses.size(), without.losses.size());
  EXPECT_GT(std::abs(want.losses.back() - without.losses.back()), 1e-3 * std::abs(without.losses.back()));
  Layout tp{1, 2, 2}, cp{1, 2, 2}, pp{1, 2, 2, 2};
  tp.tp = 2;
  cp.cp = 2;
  expect_near(rank0_result(with_dropout(tp), 4), want, 1e-6, "dropout, ep 2 of dp_shard 2 x tp 2 (SP)");
  expect_near(rank0_result(with_dropout(cp), 4), want, 1e-6, "dropout, ep 2 of cp 2 (ring) x dp_shard 2");
  expect_near(rank0_result(with_dropout(pp), 4), want, 1e-6, "dropout, ep 2 of dp_shard 2 x pp 2 (1F1B)");
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
  test::expect_error([&] { train_on_ranks(c, 4); }, {"MoE: rank ", "rows, over its capacity of 32"});
  test::expect_error(
      [&] { parse_config("model: {family: qwen3_moe, capacity_policy: drop_first}", {}).model->validate(); },
      "capacity_policy 'drop_first' is unknown");
  fs::remove_all(dir);
}

// Writes `c`'s model, its parameters drawn from `seed`, as a Hugging Face directory (config.json
// and safetensors, each layer's experts split per expert) under `dir`, from 2 expert-parallel ranks.
void export_hf(TrainConfig c, uint64_t seed, const std::string& dir) {
  c.model.as<Qwen3MoeConfig>().load_balance_rate = 0;  // like Qwen's own files: no expert bias
  test::run(2, [&](const comm::ProcessGroup& world) {
    const auto model = models::make_qwen3_moe(c.model.as<Qwen3MoeConfig>());
    parallelize_module(*model, init_device_mesh(world, "cpu", {2}, {"ep"}), {{"layers.*.mlp", ExpertParallel()}});
    nn::init_parameters(*model, seed);
    const dcp::StateDict state = dcp::model_state_dict(*model, "");
    dcp::HfSaveOptions options;
    options.files = {{"config.json", models::to_hf_config(*c.model)}};
    dcp::save_hf(
        state, dir, world,
        [&](const std::string& fqn) -> dcp::HfName {
          const models::HfPlace place = models::hf_place(fqn, state.tensors.at(fqn).sizes());
          return dcp::HfName(place.names, place.stacked);
        },
        options);
  });
}

// model.from_hf: a run starts from the Hugging Face weights under any layout. From one rank, ep 2 of
// dp_shard 4, ep 2 of dp_shard 2 x tp 2 and ep 2 x pp 2 (each rank reads only its pieces, an ep
// rank only its experts' slices of the per-expert tensors): the same per-step losses and gradient
// norms within 1e-6. The files hold no expert bias, so balancing starts from zeros. Files written
// from the run's own seed give the run without model.from_hf bitwise; other weights change the loss.
TEST(Qwen3Moe, HpTrainStartsFromHuggingFaceWeightsUnderAnyLayout) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_from_hf_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const auto config = [&](Layout layout, const std::string& from_hf) {
    layout.layers = 4;
    TrainConfig c = qwen3_moe_config(layout, 4, dir);
    c.model.as<Qwen3MoeConfig>().load_balance_rate = 0.01;
    c.model_from_hf = from_hf;
    c.train.steps = 4;
    c.run_dir += from_hf.empty() ? "_init" : "_" + fs::path(from_hf).filename().string();
    return c;
  };
  const std::string other = (dir / "hf_seed_23").string(), own = (dir / "hf_seed_11").string();
  export_hf(config({}, ""), 23, other);
  export_hf(config({}, ""), 11, own);
  const TrainResult one = rank0_result(config({}, other), 1);
  ASSERT_EQ(one.losses.size(), 4u);
  Layout tp{1, 2, 2}, pp{1, 2, 2, 2};
  tp.tp = 2;
  for (const auto& [layout, what] : std::vector<std::pair<Layout, std::string>>{
           {{1, 4, 2}, "ep 2 of dp_shard 4"}, {tp, "ep 2 of dp_shard 2 x tp 2"}, {pp, "ep 2 of dp_shard 2 x pp 2"}})
    expect_near(rank0_result(config(layout, other), layout.world()), one, 1e-6, what);
  const TrainResult drawn = rank0_result(config({}, ""), 1);
  EXPECT_GT(std::abs(drawn.losses[0] - one.losses[0]), 1e-3) << "the weights of seed 23 were not loaded";
  EXPECT_EQ(rank0_result(config({}, own), 1).losses, drawn.losses);
  fs::remove_all(dir);
}

// model.from_hf takes model.family and the architecture from config.json; a key that says otherwise,
// another family, and a directory without config.json are refused by name.
TEST(Qwen3Moe, FromHfTakesTheArchitectureFromConfigJson) {
  const fs::path dir = fs::temp_directory_path() / ("hp_qwen3_moe_hf_config_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  TrainConfig published = parse_config("model: {family: qwen3_moe}", {});
  published.model.as<Qwen3MoeConfig>() = models::qwen3_30b_a3b();
  std::ofstream(dir / "config.json") << models::to_hf_config(*published.model);
  const std::string from = "model.from_hf=" + dir.string();
  const TrainConfig c = parse_config("model: {load_balance_rate: 0.001}", {from});
  EXPECT_EQ(c.model->family(), "qwen3_moe");
  EXPECT_EQ(models::to_hf_config(*c.model), models::to_hf_config(*published.model));
  EXPECT_EQ(c.model.as<Qwen3MoeConfig>().load_balance_rate, 0.001);     // training keys stay ours
  EXPECT_EQ(parse_config(to_json(c), {}).model_from_hf, dir.string());  // the run's config.json loads back
  EXPECT_EQ(parse_config("model: {experts: 128}", {from}).model.as<Qwen3MoeConfig>().experts, 128);
  test::expect_error([&] { parse_config("model: {experts: 64}", {from}); },
                     {"model.experts is 64 but", "config.json gives 128"});
  test::expect_error([&] { parse_config("model: {family: llama}", {from}); }, "model.family is llama but");
  test::expect_error([&] { parse_config("", {"model.from_hf=" + (dir / "none").string()}); },
                     {"model.from_hf", "none/config.json"});
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hp::train
