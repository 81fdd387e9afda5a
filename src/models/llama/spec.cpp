#include "hp/models/llama/spec.h"

#include <algorithm>
#include <sstream>

#include "hp/models/llama/parallelize.h"
#include "hp/pp/schedule.h"

namespace hp::models {

ConfigFields llama_config_fields(LlamaConfig& config, bool with_mlp) {
  ConfigFields fields = {{"vocab", &config.vocab},
                         {"dim", &config.dim},
                         {"layers", &config.layers},
                         {"heads", &config.heads},
                         {"kv_heads", &config.kv_heads},
                         {"head_dim", &config.head_dim},
                         {"ffn_hidden", &config.ffn_hidden},
                         {"max_seq", &config.max_seq},
                         {"rope_theta", &config.rope_theta},
                         {"norm_eps", &config.norm_eps},
                         {"qk_norm", &config.qk_norm},
                         {"tie_embeddings", &config.tie_embeddings},
                         {"residual_dropout", &config.residual_dropout},
                         {"attention_dropout", &config.attention_dropout}};
  if (!with_mlp)
    fields.erase(std::find_if(fields.begin(), fields.end(), [](const auto& f) { return f.first == "ffn_hidden"; }));
  return fields;
}

ConfigFields LlamaSpec::fields() { return llama_config_fields(config, /*with_mlp=*/true); }

void LlamaSpec::validate_parallel(const ParallelDims& dims, const RecipeOptions& options) const {
  validate_llama_dims(dims, config);
  if (dims.cp > 1) options.cp.check_heads(dims.cp, config.heads / dims.tp, config.kv_heads / dims.tp);
  HP_CHECK(dims.pp == 1 || !config.tie_embeddings || !pp::places_in_a_v(options.pipeline.schedule),
           "model.tie_embeddings with parallel.pp_schedule ", options.pipeline.schedule,
           " is not supported yet (its first and last stages "
           "share rank 0, so they would share the tied weight)");
}

// Per token, fp32: ~14 activations of width dim per layer kept for backward (norms, q/k/v,
// attention output, the MLP's three), plus the logits twice (values and softmax), TP-sharded.
double LlamaSpec::activation_bytes_per_token(const ParallelDims& dims) const {
  return 4.0 * (14.0 * config.layers * config.dim / dims.tp + 2.0 * config.vocab / dims.tp);
}

std::string LlamaSpec::describe() const {
  std::ostringstream out;
  out << "llama dim " << config.dim << ", " << config.layers << " layers, " << config.heads << " heads ("
      << config.kv_heads << " KV), ffn " << config.ffn_hidden << ", vocab " << config.vocab;
  return out.str();
}

ModelParts LlamaSpec::build(const DeviceMesh& mesh, const ParallelDims& dims, const RecipeOptions& options) const {
  return parallelize_llama(std::make_shared<Llama>(config), mesh, dims, options);
}

}  // namespace hp::models
