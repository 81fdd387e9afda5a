// Hugging Face export and import: bitwise round trip across layouts, files a plain safetensors reader
// opens, HF names.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <mutex>

#include "hp/dcp/hf.h"
#include "hp/dcp/state_dict.h"
#include "hp/models/llama/hf_names.h"
#include "hp/models/llama/parallelize.h"
#include "hp/nn/init.h"
#include "plain_safetensors.h"
#include "test_util.h"

namespace hp {
namespace {
namespace fs = std::filesystem;

models::LlamaConfig config() {
  models::LlamaConfig c;
  c.qk_norm = false;
  return c;
}

TEST(HfNames, RoundTripEveryParameter) {
  models::LlamaConfig c = config();
  c.qk_norm = true;
  models::Llama model(c);
  for (const auto& item : model.named_parameters()) {
    const std::string hf = models::llama_to_hf_name(item.key());
    ASSERT_FALSE(hf.empty()) << item.key();
    EXPECT_EQ(models::llama_from_hf_name(hf), item.key());
  }
  EXPECT_EQ(models::llama_to_hf_name("layers.1.attn.q_proj.weight"), "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(models::llama_to_hf_name("layers.0.mlp_norm.weight"), "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(models::llama_to_hf_name("output.weight"), "lm_head.weight");
  EXPECT_EQ(models::llama_to_hf_name("layers.x.attn.q_proj.weight"), "");
}

// Exported from TP=2 (in shards with an index), read by a plain reader, imported into FSDP on 4
// ranks and into one process: every parameter bitwise equal to the original.
// HfSaveOptions::files go beside the tensors (config.json, generation_config.json); a name that
// is not a plain file name is refused.
TEST(Hf, FilesAreWrittenBesideTheTensors) {
  const std::string dir = test::scratch_dir("hf_files");
  test::run(2, [&](const comm::ProcessGroup& world) {
    dcp::StateDict state;
    state.tensors["w"] = at::ones({2, 3});
    dcp::HfSaveOptions options;
    options.files = {{"config.json", "{\"model_type\": \"llama\"}\n"}, {"generation_config.json", "{}\n"}};
    dcp::save_hf(
        state, dir, world, [](const std::string& name) { return name; }, options);
    options.files = {{"../outside.json", "{}"}};  // refused on every rank before any collective
    test::expect_error(
        [&] {
          dcp::save_hf(
              state, dir, world, [](const std::string& n) { return n; }, options);
        },
        "'../outside.json' is not a file name");
  });
  std::ifstream config(dir + "/config.json");
  const std::string text((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "{\"model_type\": \"llama\"}\n");
  EXPECT_TRUE(std::filesystem::exists(dir + "/generation_config.json"));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir).parent_path() / "outside.json"));
  EXPECT_TRUE(at::equal(dcp::load_hf_whole(dir).tensors.at("w"), at::ones({2, 3})));
}

// A tensor that stacks several Hugging Face tensors on its dim 0 (a MoE layer's experts) is
// written as its pieces, each under its own name, from a sharded source; read back into layouts
// that split the pieces (Shard(0): each rank reads its experts) or cut across them (Shard(1)),
// every element is the original's, bitwise. A stack whose pieces differ in shape is refused.
TEST(Hf, StackedTensorsAreWrittenAsTheirPiecesAndReadBackSharded) {
  const std::string dir = test::scratch_dir("hf_stacked");
  const at::Tensor experts = at::arange(60, at::kFloat).view({4, 3, 5}).mul(0.37),
                   other = at::arange(4, at::kFloat).view({2, 2});
  const dcp::NameMap names = [](const std::string& name) -> dcp::HfName {
    if (name == "w") return dcp::HfName::stacked({"e.0.w", "e.1.w", "e.2.w", "e.3.w"});
    return name;
  };
  test::run(2, [&](const comm::ProcessGroup& world) {
    const DeviceMesh mesh = init_device_mesh(world, "cpu", {2}, {"ep"});
    dcp::StateDict state;
    state.tensors["w"] = distribute_tensor(experts, mesh, {Shard(0)});
    state.tensors["t"] = other;
    dcp::save_hf(state, dir, world, names);
    for (const Placement& p : {Shard(0), Shard(1), Shard(2)}) {
      dcp::StateDict into;
      into.tensors["w"] = distribute_tensor(at::zeros({4, 3, 5}), mesh, {p});
      into.tensors["t"] = at::zeros({2, 2});
      dcp::load_hf(into, dir, names);
      EXPECT_TRUE(at::equal(test::whole(into.tensors["w"]), experts)) << p.str();
      EXPECT_TRUE(at::equal(into.tensors["t"], other));
    }
  });
  const auto plain = test::read_safetensors(dir + "/model.safetensors");
  ASSERT_EQ(plain.size(), 5u);
  for (int64_t e = 0; e < 4; ++e) EXPECT_TRUE(at::equal(plain.at("e." + std::to_string(e) + ".w"), experts[e])) << e;
  dcp::StateDict odd;
  odd.tensors["w"] = at::zeros({2, 2});
  test::expect_error(
      [&] { dcp::load_hf(odd, dir, [](const std::string&) {
              return dcp::HfName::stacked({"e.0.w", "t"});
            }); },
      "differs in dtype or shape from 'e.0.w'");
}

TEST(Hf, ExportImportRoundTripIsBitwise) {
  const std::string dir = test::scratch_dir("hf");
  std::map<std::string, at::Tensor> original;
  std::mutex mu;
  test::run(2, [&](const comm::ProcessGroup& world) {
    models::Llama model(config());
    parallelize_module(model, init_device_mesh(world, "cpu", {2}, {"tp"}), models::llama_tp_plan({}));
    nn::init_parameters(model, 5);
    dcp::HfSaveOptions options;
    options.max_shard_bytes = 16 << 10;  // several files and an index
    dcp::save_hf(dcp::model_state_dict(model, ""), dir, world, models::llama_to_hf_name, options);
    for (const auto& item : model.named_parameters()) {
      const at::Tensor whole = test::whole(item.value()).detach();
      std::lock_guard<std::mutex> lock(mu);
      if (world.rank() == 0) original[item.key()] = whole;
    }
  });
  ASSERT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  const auto index = nlohmann::json::parse(std::ifstream(dir + "/model.safetensors.index.json"));
  std::map<std::string, at::Tensor> plain;
  for (const auto& [hf, file] : index.at("weight_map").items()) {
    const auto tensors = test::read_safetensors(dir + "/" + file.get<std::string>());
    ASSERT_TRUE(tensors.count(hf)) << hf;
    plain[hf] = tensors.at(hf);
  }
  ASSERT_EQ(plain.size(), original.size());
  for (const auto& [name, want] : original)
    test::check_close(plain.at(models::llama_to_hf_name(name)), want, "plain reader: " + name, /*bitwise=*/true);

  test::run(4, [&](const comm::ProcessGroup& world) {
    models::Llama model(config());
    ParallelDims dims;
    dims.dp_shard = 4;
    models::parallelize_llama(model, build_mesh(world, dims), dims);
    nn::init_parameters(model, 6);  // other values, overwritten by the import
    auto state = dcp::model_state_dict(model, "");
    dcp::load_hf(state, dir, models::llama_to_hf_name);
    for (const auto& item : model.named_parameters())
      test::check_close(test::whole(item.value()).detach(), original.at(item.key()), "FSDP import: " + item.key(),
                        true);
  });
  models::Llama single(config());
  nn::init_parameters(single, 7);
  auto state = dcp::model_state_dict(single, "");
  dcp::load_hf(state, dir, models::llama_to_hf_name);
  for (const auto& item : single.named_parameters())
    test::check_close(item.value().detach(), original.at(item.key()), "single import: " + item.key(), true);
  test::expect_error(
      [&] {
        dcp::StateDict extra;
        extra.tensors["layers.9.attn.q_proj.weight"] = at::zeros({32, 32});
        dcp::load_hf(extra, dir, models::llama_to_hf_name);
      },
      "has no tensor 'model.layers.9.self_attn.q_proj.weight'");
  fs::remove_all(dir);
}

// A bf16 file (what most published models ship) into an fp32 model, sharded over 2 FSDP ranks and
// whole: every parameter equals the bf16 rounding of the original bitwise. Integer and float
// tensors do not convert into each other.
TEST(Hf, ImportConvertsFloatDtypes) {
  const std::string dir = test::scratch_dir("hf_bf16");
  models::Llama source(config());
  nn::init_parameters(source, 5);
  dcp::StateDict bf16;
  for (const auto& item : source.named_parameters()) bf16.tensors[item.key()] = item.value().detach().to(at::kBFloat16);
  test::run(1, [&](const comm::ProcessGroup& world) { dcp::save_hf(bf16, dir, world, models::llama_to_hf_name); });
  const auto expect_rounded = [&](models::Llama& model, const std::string& what) {
    for (const auto& item : model.named_parameters()) {
      const at::Tensor got = test::whole(item.value()).detach();
      ASSERT_EQ(got.scalar_type(), at::kFloat) << item.key();
      test::check_close(got, bf16.tensors.at(item.key()).to(at::kFloat), what + ": " + item.key(), /*bitwise=*/true);
    }
  };
  test::run(2, [&](const comm::ProcessGroup& world) {
    models::Llama model(config());
    ParallelDims dims;
    dims.dp_shard = 2;
    models::parallelize_llama(model, build_mesh(world, dims), dims);
    nn::init_parameters(model, 6);
    auto state = dcp::model_state_dict(model, "");
    dcp::load_hf(state, dir, models::llama_to_hf_name);
    expect_rounded(model, "FSDP import");
  });
  models::Llama single(config());
  nn::init_parameters(single, 7);
  auto state = dcp::model_state_dict(single, "");
  dcp::load_hf(state, dir, models::llama_to_hf_name);
  expect_rounded(single, "single import");
  test::expect_error(
      [&] {
        dcp::StateDict ints;
        ints.tensors["embed.weight"] = at::zeros(bf16.tensors.at("embed.weight").sizes(), at::kLong);
        dcp::load_hf(ints, dir, models::llama_to_hf_name);
      },
      "dcp.load: tensor 'embed.weight' is Long but the Hugging Face files in");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace hp
