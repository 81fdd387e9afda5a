#include "hp/models/qwen3_moe/spec.h"

#include <sstream>

#include "hp/models/llama/spec.h"
#include "hp/models/qwen3_moe/parallelize.h"

namespace hp::models {

ConfigFields Qwen3MoeSpec::fields() {
  ConfigFields fields = llama_config_fields(config.llama, /*with_mlp=*/false);
  fields.insert(fields.end(), {{"experts", &config.experts},
                               {"top_k", &config.top_k},
                               {"expert_hidden", &config.expert_hidden},
                               {"norm_topk_prob", &config.norm_topk_prob},
                               {"load_balance_rate", &config.load_balance_rate},
                               {"capacity_factor", &config.capacity_factor},
                               {"capacity_policy", &config.capacity_policy},
                               {"aux_loss_coeff", &config.aux_loss_coeff},
                               {"seq_aux_loss_coeff", &config.seq_aux_loss_coeff},
                               {"z_loss_coeff", &config.z_loss_coeff}});
  return fields;
}

void Qwen3MoeSpec::validate_parallel(const ParallelDims& dims, const RecipeOptions& /*options*/) const {
  validate_qwen3_moe_dims(dims, config);
}

// Per token, fp32: attention's ~8 activations of width dim per layer, the router's scores, and
// top_k copies of the expert rows (input, three hidden-size activations, output), plus the logits
// twice; with tp, a rank holds a share of each (heads, sequence shards, vocabulary).
double Qwen3MoeSpec::activation_bytes_per_token(const ParallelDims& dims) const {
  const LlamaConfig& l = config.llama;
  const double per_layer = 8.0 * l.dim + config.experts + config.top_k * (2.0 * l.dim + 3.0 * config.expert_hidden);
  return 4.0 * (per_layer * l.layers + 2.0 * l.vocab) / static_cast<double>(dims.tp);
}

std::string Qwen3MoeSpec::describe() const {
  const LlamaConfig& l = config.llama;
  std::ostringstream out;
  out << "qwen3_moe dim " << l.dim << ", " << l.layers << " layers, " << l.heads << " heads (" << l.kv_heads << " KV), "
      << config.experts << " experts (top " << config.top_k << ", hidden " << config.expert_hidden << "), vocab "
      << l.vocab << " (" << config.active_parameter_count() << " parameters active per token)";
  return out.str();
}

ModelParts Qwen3MoeSpec::build(const DeviceMesh& mesh, const ParallelDims& dims, const RecipeOptions& options) const {
  return parallelize_qwen3_moe(make_qwen3_moe(config), mesh, dims, config, options);
}

}  // namespace hp::models
