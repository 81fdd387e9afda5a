// Hugging Face config.json for our model families, and back (for hp-ckpt convert):
//   llama, qk_norm false   <-> LlamaForCausalLM     (model_type "llama")
//   llama, qk_norm true    <-> Qwen3ForCausalLM     (model_type "qwen3")
//   qwen3_moe              <-> Qwen3MoeForCausalLM  (model_type "qwen3_moe", every layer a MoE)
// Only the architecture maps; training choices (balancing, capacity, auxiliary losses) stay ours.
#pragma once

#include <string>

#include "hp/models/model_spec.h"

namespace hp::models {

// config.json's text for `spec`'s model, whose weights the files hold in `torch_dtype` ("float32",
// "bfloat16", "float16"); throws hp::Error for a family with no Hugging Face class.
std::string to_hf_config(const ModelSpec& spec, const std::string& torch_dtype = "float32");

// generation_config.json for it: how hp-train generates (greedy, up to max_position_embeddings
// tokens). Our byte-level models have no BOS/EOS/pad tokens, so it names none.
std::string to_hf_generation_config(const ModelSpec& spec);

// A config.json's model as hp-train's model.* keys: a YAML "model:" block, family included. Throws
// hp::Error naming what we cannot build: another model_type, attention biases, rope_scaling,
// sliding windows, dense layers in a MoE, an activation other than silu.
std::string model_keys_from_hf_config(const std::string& config_json);

}  // namespace hp::models
