// A Hugging Face export opened by transformers: a Llama with grouped-query heads, a rope theta of its
// own and every parameter perturbed (no two tensors of a kind alike, as after training) is exported by
// save_hf with to_hf_config's config.json; transformers must load it as LlamaForCausalLM and give our
// logits for the same tokens (tests/dcp/transformers_logits.py states the tolerances). Needs a Python
// with torch and transformers, named by HP_TRANSFORMERS_PYTHON (scripts/device-check sets it on the
// GPU machine); skipped without it.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "hp/dcp/hf.h"
#include "hp/dcp/state_dict.h"
#include "hp/models/hf_config.h"
#include "hp/models/llama/hf_names.h"
#include "hp/models/llama/spec.h"
#include "hp/nn/init.h"
#include "hp_build_paths.h"
#include "test_util.h"

namespace hp {
namespace {

void write_bytes(const std::string& path, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

TEST(HfTransformers, LlamaForCausalLMGivesOurLogits) {
  const char* python = std::getenv("HP_TRANSFORMERS_PYTHON");
  if (python == nullptr || *python == '\0')
    GTEST_SKIP() << "HP_TRANSFORMERS_PYTHON is not set (a Python with transformers)";
  models::LlamaConfig c;
  c.vocab = 256;
  c.dim = 128;
  c.layers = 2;
  c.heads = 8;
  c.kv_heads = 2;
  c.ffn_hidden = 352;
  c.max_seq = 64;
  c.rope_theta = 500000.0;
  c.norm_eps = 1e-5;
  models::Llama model(c);
  nn::init_parameters(model, 21);
  {
    at::NoGradGuard no_grad;
    at::manual_seed(5);
    for (at::Tensor& p : model.parameters()) p.add_(at::randn_like(p) * 0.05);
  }
  const std::string dir = test::scratch_dir("hf_transformers");
  test::run(1, [&](const comm::ProcessGroup& world) {
    dcp::HfSaveOptions options;
    options.files = {{"config.json", models::to_hf_config(models::LlamaSpec(c))}};
    dcp::save_hf(dcp::model_state_dict(model, ""), dir, world, models::llama_to_hf_name, options);
  });
  const std::string text = "The export must give the same logits in transformers.";
  const at::Tensor tokens =
      at::tensor(std::vector<int64_t>(text.begin(), text.end()), at::kLong).unsqueeze(0);  // bytes
  at::Tensor logits;
  {
    at::NoGradGuard no_grad;
    logits = model(tokens).squeeze(0);
  }
  write_bytes(dir + "/hp_tokens.bin", tokens);
  write_bytes(dir + "/hp_logits.bin", logits.to(at::kFloat));

  const std::string log = dir + "/transformers.log";
  const auto quoted = [](const std::string& path) { return "'" + path + "'"; };  // our paths hold no quote
  const std::string command = std::string(python) + " " + quoted(HP_SOURCE_DIR "/tests/dcp/transformers_logits.py") +
                              " " + quoted(dir) + " >" + quoted(log) + " 2>&1";
  const int status = std::system(command.c_str());
  std::stringstream output;
  output << std::ifstream(log).rdbuf();
  std::cout << output.str();
  EXPECT_EQ(status, 0) << output.str();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hp
