// A model family the library has never seen plugs into the trainer through the registry alone:
// its model.* keys parse, its checks run, and train() trains it, on one rank and under FSDP with
// the same losses. The family ("mixer": an MLP-only language model with GPT-style GELU MLPs) lives
// entirely in this file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "hp/models/model_spec.h"
#include "hp/nn/layers.h"
#include "hp/parallel/loss_parallel.h"
#include "hp/train/trainer.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;

struct MixerConfig {
  int64_t vocab = 256, dim = 32, hidden = 64, layers = 2, max_seq = 128;
};

class MixerBlock : public nn::Module {
 public:
  explicit MixerBlock(const MixerConfig& c)
      : nn::Module("MixerBlock"),
        norm(add_module("norm", std::make_shared<nn::RMSNorm>(c.dim))),
        up(add_module("up", std::make_shared<nn::Linear>(c.dim, c.hidden, false))),
        down(add_module("down", std::make_shared<nn::Linear>(c.hidden, c.dim, false))) {}
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<nn::Linear> up, down;

 protected:
  // GELU allocates scratch memory through ATen's raw_allocate, which once aborted any process that
  // had a MemoryTracker (hp-train has one, for peak_mem_mb).
  at::Tensor forward(const at::Tensor& x) override { return x + (*down)(at::gelu((*up)((*norm)(x)))); }
};

class Mixer : public nn::Module {
 public:
  explicit Mixer(const MixerConfig& c)
      : nn::Module("Mixer"),
        embed(add_module("embed", std::make_shared<nn::Embedding>(c.vocab, c.dim))),
        layers(add_module("layers", std::make_shared<nn::Sequential>())),
        head(add_module("head", std::make_shared<nn::Linear>(c.dim, c.vocab, false))) {
    for (int64_t i = 0; i < c.layers; ++i) layers->push_back(std::make_shared<MixerBlock>(c));
  }
  std::shared_ptr<nn::Embedding> embed;
  std::shared_ptr<nn::Sequential> layers;
  std::shared_ptr<nn::Linear> head;

 protected:
  at::Tensor forward(const at::Tensor& tokens) override { return (*head)((*layers)((*embed)(tokens))); }
};

class MixerSpec : public models::ModelSpecOf<MixerConfig> {
 public:
  MixerSpec() : ModelSpecOf(MixerConfig{}) {}
  std::unique_ptr<models::ModelSpec> clone() const override { return std::make_unique<MixerSpec>(*this); }
  std::string family() const override { return "mixer"; }
  models::ConfigFields fields() override {
    return {{"vocab", &config.vocab},
            {"dim", &config.dim},
            {"hidden", &config.hidden},
            {"layers", &config.layers},
            {"max_seq", &config.max_seq}};
  }
  void validate() const override {
    HP_CHECK(config.vocab > 0 && config.dim > 0 && config.hidden > 0 && config.layers > 0,
             "mixer: sizes must be positive");
  }
  void validate_parallel(const ParallelDims& dims, const models::RecipeOptions&) const override {
    HP_CHECK(dims.tp == 1 && dims.pp == 1 && dims.cp == 1 && dims.ep == 1, "the mixer recipe only shards data");
  }
  int64_t vocab() const override { return config.vocab; }
  int64_t max_seq() const override { return config.max_seq; }
  int64_t layers() const override { return config.layers; }
  int64_t parameter_count() const override {
    return 2 * config.vocab * config.dim + config.layers * (config.dim + 2 * config.dim * config.hidden);
  }
  double flops_per_token(int64_t) const override { return 6.0 * static_cast<double>(parameter_count()); }
  double activation_bytes_per_token(const ParallelDims&) const override {
    return 4.0 * static_cast<double>(config.layers * (2 * config.dim + 2 * config.hidden) + 2 * config.vocab);
  }
  std::string describe() const override { return "mixer dim " + std::to_string(config.dim); }
  models::ModelParts build(const DeviceMesh& mesh, const ParallelDims& dims,
                           const models::RecipeOptions& options) const override {
    auto model = std::make_shared<Mixer>(config);
    if (dims.dp() > 1) {
      const DeviceMesh dp_mesh = data_parallel_mesh(mesh, dims);
      for (auto& [fqn, block] : nn::match_modules(*model, "layers.*")) fully_shard(*block, dp_mesh, options.fsdp);
      fully_shard(*model, dp_mesh, options.fsdp);
    }
    models::ModelParts parts;
    parts.model = model;
    parts.modules = {model};
    parts.loss = [](const at::Tensor& logits, const at::Tensor& targets) { return cross_entropy(logits, targets); };
    parts.hidden_matrices = {"layers.*.up.weight", "layers.*.down.weight"};
    parts.other_parameters = {"*.weight", "layers.*.norm.weight"};
    return parts;
  }
};

const bool kRegistered = [] {
  models::register_model_family("mixer", [] { return std::make_unique<MixerSpec>(); });
  return true;
}();

TEST(ModelFamily, AnOutsideFamilyParsesAndValidatesThroughTheRegistry) {
  ASSERT_TRUE(kRegistered);
  const TrainConfig c = parse_config(
      "model: {family: mixer, hidden: 96}\nparallel: {dp_shard: 2}\ntrain: {micro_batch: 8}", {"model.layers=3"});
  EXPECT_EQ(c.model->family(), "mixer");
  EXPECT_EQ(c.model.as<MixerConfig>().hidden, 96);
  EXPECT_EQ(c.model.as<MixerConfig>().layers, 3);
  EXPECT_NE(to_json(c).find("\"model.hidden\":96"), std::string::npos) << to_json(c);
  validate(c, 2);
  test::expect_error([] { parse_config("model: {family: mixer, heads: 4}", {}); },
                     {"unknown key 'model.heads'", "model.hidden"});
  test::expect_error([] { parse_config("model: {heads: 4}", {"model.family=mixer"}); }, "unknown key 'model.heads'");
  test::expect_error([] { parse_config("model: {family: gpt9}", {}); },
                     {"model.family 'gpt9' is unknown", "llama", "mixer"});
  test::expect_error([&] { validate(parse_config("model: {family: mixer}\nparallel: {tp: 2}", {}), 2); },
                     "the mixer recipe only shards data");
  test::expect_error([&] { (void)c.model.as<int>(); }, "model.family is mixer");
}

std::vector<double> train_mixer(int world, const fs::path& dir) {
  TrainConfig c = parse_config("model: {family: mixer}", {});
  c.run_dir = (dir / ("run" + std::to_string(world))).string();
  c.seed = 5;
  c.parallel.dp_shard = world;
  c.data.sources = {write_corpus(dir / "text")};
  c.data.cache_dir = (dir / "cache").string();
  c.data.seq_len = 32;
  c.train.steps = 8;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.optimizer.lr = 3e-3;
  c.eval.batches = 1;
  return rank0_losses(c, world);
}

TEST(ModelFamily, TheTrainerTrainsAnOutsideFamilyOnOneRankAndUnderFsdpAlike) {
  ASSERT_TRUE(kRegistered);
  const fs::path dir = fs::temp_directory_path() / ("hp_model_family_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::vector<double> one = train_mixer(1, dir), two = train_mixer(2, dir);
  ASSERT_EQ(one.size(), 8u);
  ASSERT_EQ(two.size(), 8u);
  EXPECT_LT(one.back(), one.front() - 0.5) << "the loss should fall";
  for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(two[i], one[i], 1e-4 * std::abs(one[i])) << "step " << i + 1;
  // peak_mem_mb is measured (the tracker saw the GELU model's allocations).
  std::ifstream metrics(dir / "run1" / "metrics.jsonl");
  double peak = 0.0;
  for (std::string line; std::getline(metrics, line);)
    if (const auto j = nlohmann::json::parse(line); j.at("kind") == "train") peak = j.at("peak_mem_mb").get<double>();
  EXPECT_GT(peak, 0.0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hp::train
