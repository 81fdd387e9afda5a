#include "hp/models/llama/hf_names.h"

#include <utility>
#include <vector>

namespace hp::models {
namespace {

// Our module path -> HF's, per segment after "layers.N." (or at the top level).
const std::vector<std::pair<std::string, std::string>>& hf_table() {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"attn.q_proj", "self_attn.q_proj"}, {"attn.k_proj", "self_attn.k_proj"},
      {"attn.v_proj", "self_attn.v_proj"}, {"attn.o_proj", "self_attn.o_proj"},
      {"attn.q_norm", "self_attn.q_norm"}, {"attn.k_norm", "self_attn.k_norm"},
      {"attn_norm", "input_layernorm"},    {"mlp_norm", "post_attention_layernorm"},
      {"mlp.gate", "mlp.gate_proj"},       {"mlp.up", "mlp.up_proj"},
      {"mlp.down", "mlp.down_proj"}};
  return table;
}

const std::vector<std::pair<std::string, std::string>>& hf_top_table() {
  static const std::vector<std::pair<std::string, std::string>> table = {{"embed.weight", "model.embed_tokens.weight"},
                                                                         {"norm.weight", "model.norm.weight"},
                                                                         {"output.weight", "lm_head.weight"}};
  return table;
}

// Maps "<prefix>N.<module>.<leaf>" through `table` (from column `from` to the other one).
std::string map_layer_name(const std::string& name, const std::string& from_prefix, const std::string& to_prefix,
                           bool forward) {
  if (name.rfind(from_prefix, 0) != 0) return "";
  const std::string rest = name.substr(from_prefix.size());
  const auto dot = rest.find('.');
  if (dot == std::string::npos || rest.find_first_not_of("0123456789") != dot) return "";
  const std::string index = rest.substr(0, dot), module_and_leaf = rest.substr(dot + 1);
  const auto last = module_and_leaf.rfind('.');
  if (last == std::string::npos) return "";
  const std::string module = module_and_leaf.substr(0, last), leaf = module_and_leaf.substr(last);
  for (const auto& [ours, hf] : hf_table())
    if ((forward ? ours : hf) == module) return to_prefix + index + "." + (forward ? hf : ours) + leaf;
  return "";
}

}  // namespace

std::string llama_to_hf_name(const std::string& fqn) {
  for (const auto& [ours, hf] : hf_top_table())
    if (fqn == ours) return hf;
  return map_layer_name(fqn, "layers.", "model.layers.", /*forward=*/true);
}

std::string llama_from_hf_name(const std::string& hf_name) {
  for (const auto& [ours, hf] : hf_top_table())
    if (hf_name == hf) return ours;
  return map_layer_name(hf_name, "model.layers.", "layers.", /*forward=*/false);
}

}  // namespace hp::models
