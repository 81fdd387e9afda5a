// Hugging Face Llama / Qwen3 names of our parameters ("layers.3.attn.q_proj.weight" <->
// "model.layers.3.self_attn.q_proj.weight", "embed.weight" <-> "model.embed_tokens.weight", ...).
// Our rotary embedding uses HF's rotate_half layout, so q/k weights map without permutation.
#pragma once

#include <string>

namespace hp::models {

// Unknown names give "".
std::string llama_to_hf_name(const std::string& fqn);
std::string llama_from_hf_name(const std::string& hf_name);

}  // namespace hp::models
