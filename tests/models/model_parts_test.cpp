// ModelParts on pipeline ranks: init_parameters draws only the rank's own stages, each parameter
// with the value a whole-model initialization gives it; stages take the layers they are given;
// offload patterns select units by name and the units inside the modules they match.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "hp/dtensor/local.h"
#include "hp/models/model_spec.h"
#include "hp/nn/init.h"
#include "hp/parallel/parallel_dims.h"
#include "hp/train/config.h"
#include "test_util.h"

namespace hp {
namespace {

// Every parameter of `model` built on one rank and drawn from `seed`, by FQN.
std::map<std::string, at::Tensor> whole_model(const models::ModelConfig& model, uint64_t seed) {
  std::map<std::string, at::Tensor> out;
  test::run(1, [&](const comm::ProcessGroup& world) {
    const models::ModelParts parts = model->build(build_mesh(world, ParallelDims{}), ParallelDims{}, {});
    parts.init_parameters(seed);
    for (const auto& item : parts.model->named_parameters()) out[item.key()] = item.value().detach().clone();
  });
  return out;
}

// Llama and Qwen3-MoE (ep 2 of dp_shard 2) on 2 pipeline ranks: each rank's stage parameters
// equal the whole model's bitwise, every other parameter has no storage, and the rank's parameter
// bytes are those of its stages alone.
TEST(ModelParts, APipelineRankDrawsOnlyItsStages) {
  const std::string attention = "vocab: 256, dim: 32, layers: 4, heads: 4, kv_heads: 2, max_seq: 16";
  for (const auto& [yaml, dp_shard, ep] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
           {"model: {family: llama, " + attention + "}", 1, 1},
           {"model: {family: qwen3_moe, " + attention + ", experts: 4}", 2, 2}}) {
    const train::TrainConfig c = train::parse_config(yaml, {});
    const auto want = whole_model(c.model, 7);
    ParallelDims dims;
    dims.pp = 2;
    dims.dp_shard = dp_shard;
    dims.ep = ep;
    test::run(static_cast<int>(dims.pp * dp_shard), [&](const comm::ProcessGroup& world) {
      models::RecipeOptions options;
      options.pipeline.micro_batches = 2;
      const models::ModelParts parts = c.model->build(build_mesh(world, dims), dims, options);
      parts.init_parameters(7);
      std::set<std::string> mine;
      int64_t bytes = 0;
      for (const auto& [fqn, t] : parts.named_tensors()) mine.insert(fqn);
      for (const auto& item : parts.model->named_parameters()) {
        const at::Tensor& local = local_tensor(item.value());
        if (!mine.count(item.key())) {
          if (!local.is_meta()) throw std::runtime_error(item.key() + " of another stage has storage");
          continue;
        }
        bytes += local.numel() * static_cast<int64_t>(local.element_size());
        test::check_close(test::whole(item.value()).detach(), want.at(item.key()), c.model->family() + " " + item.key(),
                          /*bitwise=*/true);
      }
      if (mine.empty() || bytes != nn::local_parameter_bytes(*parts.model))
        throw std::runtime_error("the rank's parameter bytes are not its stages' alone");
    });
  }
}

// RecipeOptions::pipeline.layers_per_stage (hp-train's parallel.pp_layers_per_stage): with 1 + 3
// layers on 2 pipeline ranks, rank 0 holds layer 0 only and rank 1 layers 1 to 3.
TEST(ModelParts, PipelineStagesTakeTheirConfiguredLayers) {
  const train::TrainConfig c =
      train::parse_config("model: {family: llama, vocab: 256, dim: 32, layers: 4, heads: 4, kv_heads: 2}", {});
  ParallelDims dims;
  dims.pp = 2;
  test::run(2, [&](const comm::ProcessGroup& world) {
    models::RecipeOptions options;
    options.pipeline.micro_batches = 2;
    options.pipeline.layers_per_stage = {1, 3};
    const models::ModelParts parts = c.model->build(build_mesh(world, dims), dims, options);
    std::set<std::string> layers;
    for (const auto& [fqn, t] : parts.named_tensors())
      if (fqn.rfind("layers.", 0) == 0) layers.insert(fqn.substr(0, fqn.find('.', 7)));
    const std::set<std::string> want = world.rank() == 0 ? std::set<std::string>{"layers.0"}
                                                         : std::set<std::string>{"layers.1", "layers.2", "layers.3"};
    if (layers != want) throw std::runtime_error("rank " + std::to_string(world.rank()) + " holds other layers");
    options.pipeline.layers_per_stage = {1, 1, 2};
    test::expect_error([&] { c.model->build(build_mesh(world, dims), dims, options); },
                       "3 layer counts for the 2 stages");
  });
}

// A pattern selects the unit it names, and the units inside a module it matches ("layers.*" a
// block's experts too, "layers.1.mlp" its experts and not its block); "root" the model's own unit
// only; no patterns every unit.
TEST(ModelParts, OffloadPatternsSelectUnitsAndTheUnitsInside) {
  using models::unit_selected;
  EXPECT_TRUE(unit_selected({}, "root"));
  EXPECT_TRUE(unit_selected({}, "layers.3"));
  EXPECT_TRUE(unit_selected({"layers.*"}, "layers.3"));
  EXPECT_TRUE(unit_selected({"layers.*"}, "layers.3.mlp.experts"));
  EXPECT_FALSE(unit_selected({"layers.*"}, "root"));
  EXPECT_FALSE(unit_selected({"layers.*"}, "stage.0"));
  EXPECT_TRUE(unit_selected({"layers.1.mlp"}, "layers.1.mlp.experts"));
  EXPECT_FALSE(unit_selected({"layers.1.mlp"}, "layers.1"));
  EXPECT_FALSE(unit_selected({"layers.1"}, "layers.10"));
  EXPECT_FALSE(unit_selected({"layers.*.mlp.experts"}, "layers.3"));
  EXPECT_TRUE(unit_selected({"root"}, "root"));
  EXPECT_FALSE(unit_selected({"root"}, "layers.0"));
  EXPECT_FALSE(unit_selected({"*"}, "root"));
  EXPECT_TRUE(unit_selected({"stage.*"}, "stage.1"));
  EXPECT_TRUE(unit_selected({"root", "stage.1"}, "stage.1"));
}

}  // namespace
}  // namespace hp
