#include "hp/models/hf_config.h"

#include <nlohmann/json.hpp>

#include <sstream>

#include "hp/core/error.h"
#include "hp/models/llama/model.h"
#include "hp/models/qwen3_moe/model.h"

namespace hp::models {
namespace {

// The decoder's keys, shared by the three classes (HF writes head_dim explicitly for Qwen3).
nlohmann::json decoder_config(const LlamaConfig& c) {
  return {{"vocab_size", c.vocab},
          {"hidden_size", c.dim},
          {"num_hidden_layers", c.layers},
          {"num_attention_heads", c.heads},
          {"num_key_value_heads", c.kv_heads},
          {"head_dim", c.head_size()},
          {"max_position_embeddings", c.max_seq},
          {"rope_theta", c.rope_theta},
          {"rms_norm_eps", c.norm_eps},
          {"tie_word_embeddings", c.tie_embeddings},
          {"attention_dropout", c.attention_dropout},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"rope_scaling", nullptr}};
}

// `j[key]` when present, else `fallback`; a value of another type is an error naming the key
// (config.json files come from strangers).
template <typename T>
T value_or(const nlohmann::json& j, const char* key, T fallback) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  try {
    return j.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    HP_FAIL("hf: config.json's '", key, "' has the wrong type (", j.at(key).type_name(), ")");
  }
}

int64_t required(const nlohmann::json& j, const char* key) {
  HP_CHECK(j.contains(key) && j.at(key).is_number_integer(), "hf: config.json lacks the integer '", key, "'");
  return j.at(key).get<int64_t>();
}

}  // namespace

std::string to_hf_config(const ModelSpec& spec, const std::string& torch_dtype) {
  nlohmann::json j;
  if (const auto* llama = dynamic_cast<const ModelSpecOf<LlamaConfig>*>(&spec)) {
    const LlamaConfig& c = llama->config;
    j = decoder_config(c);
    j["intermediate_size"] = c.ffn_hidden;
    j["model_type"] = c.qk_norm ? "qwen3" : "llama";
    j["architectures"] = {c.qk_norm ? "Qwen3ForCausalLM" : "LlamaForCausalLM"};
  } else if (const auto* moe = dynamic_cast<const ModelSpecOf<Qwen3MoeConfig>*>(&spec)) {
    const Qwen3MoeConfig& c = moe->config;
    HP_CHECK(c.llama.qk_norm, "hf: Qwen3MoeForCausalLM has QK-norm attention; this qwen3_moe model has qk_norm false");
    j = decoder_config(c.llama);
    j.update({{"model_type", "qwen3_moe"},
              {"architectures", {"Qwen3MoeForCausalLM"}},
              {"num_experts", c.experts},
              {"num_experts_per_tok", c.top_k},
              {"moe_intermediate_size", c.expert_hidden},
              {"norm_topk_prob", c.norm_topk_prob},
              {"decoder_sparse_step", 1},
              {"mlp_only_layers", nlohmann::json::array()},
              {"intermediate_size", c.expert_hidden},  // the dense MLP size, which no layer uses
              {"router_aux_loss_coef", c.aux_loss_coeff},
              {"output_router_logits", c.aux_loss_coeff > 0}});
  } else {
    HP_FAIL("hf: the ", spec.family(), " family has no Hugging Face config");
  }
  j["torch_dtype"] = torch_dtype;
  return j.dump(2) + "\n";
}

std::string to_hf_generation_config(const ModelSpec& spec) {
  return nlohmann::json({{"do_sample", false}, {"max_length", spec.max_seq()}}).dump(1) + "\n";
}

std::string model_keys_from_hf_config(const std::string& config_json) {
  const nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  HP_CHECK(j.is_object(), "hf: config.json is not a JSON object");
  const std::string type = value_or<std::string>(j, "model_type", "");
  HP_CHECK(type == "llama" || type == "qwen3" || type == "qwen3_moe", "hf: model_type '", type,
           "' is not one we build (llama, qwen3, qwen3_moe)");
  HP_CHECK(!value_or(j, "attention_bias", false), "hf: attention_bias true: our attention has no biases");
  HP_CHECK(!j.contains("rope_scaling") || j.at("rope_scaling").is_null(),
           "hf: rope_scaling is set: our rotary embedding has no scaling");
  HP_CHECK(!value_or(j, "use_sliding_window", false), "hf: use_sliding_window true: our attention is full");
  HP_CHECK(value_or<std::string>(j, "hidden_act", "silu") == "silu", "hf: hidden_act '",
           value_or<std::string>(j, "hidden_act", ""), "': our MLPs are SwiGLU (silu)");
  const int64_t dim = required(j, "hidden_size"), heads = required(j, "num_attention_heads");
  HP_CHECK(heads > 0, "hf: num_attention_heads must be positive, got ", heads);
  const int64_t head_dim = value_or<int64_t>(j, "head_dim", dim / heads);
  std::ostringstream out;
  out << "model:\n"
      << "  family: " << (type == "qwen3_moe" ? "qwen3_moe" : "llama") << "\n"
      << "  vocab: " << required(j, "vocab_size") << "\n"
      << "  dim: " << dim << "\n"
      << "  layers: " << required(j, "num_hidden_layers") << "\n"
      << "  heads: " << heads << "\n"
      << "  kv_heads: " << value_or<int64_t>(j, "num_key_value_heads", heads) << "\n"
      << "  head_dim: " << (head_dim == dim / heads ? 0 : head_dim) << "\n"
      << "  max_seq: " << required(j, "max_position_embeddings") << "\n"
      << "  rope_theta: " << nlohmann::json(value_or(j, "rope_theta", 10000.0)).dump() << "\n"
      << "  norm_eps: " << nlohmann::json(value_or(j, "rms_norm_eps", 1e-6)).dump() << "\n"
      << "  qk_norm: " << (type == "llama" ? "false" : "true") << "\n"
      << "  tie_embeddings: " << (value_or(j, "tie_word_embeddings", false) ? "true" : "false") << "\n"
      << "  attention_dropout: " << nlohmann::json(value_or(j, "attention_dropout", 0.0)).dump() << "\n";
  if (type == "qwen3_moe") {
    HP_CHECK(
        value_or<int64_t>(j, "decoder_sparse_step", 1) == 1 &&
            value_or(j, "mlp_only_layers", nlohmann::json::array()).empty(),
        "hf: some layers are dense (decoder_sparse_step or mlp_only_layers): our qwen3_moe makes every layer a MoE");
    out << "  experts: " << required(j, "num_experts") << "\n"
        << "  top_k: " << required(j, "num_experts_per_tok") << "\n"
        << "  expert_hidden: " << required(j, "moe_intermediate_size") << "\n"
        << "  norm_topk_prob: " << (value_or(j, "norm_topk_prob", false) ? "true" : "false") << "\n";
  } else {
    out << "  ffn_hidden: " << required(j, "intermediate_size") << "\n";
  }
  return out.str();
}

}  // namespace hp::models
