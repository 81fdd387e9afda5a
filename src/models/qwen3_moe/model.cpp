#include "hp/models/qwen3_moe/model.h"

#include <vector>

#include "hp/core/checked_size.h"
#include "hp/core/error.h"

namespace hp::models {

LlamaConfig Qwen3MoeConfig::default_attention() {
  LlamaConfig c;
  c.qk_norm = true;
  return c;
}

nn::MoEOptions Qwen3MoeConfig::moe_options() const {
  nn::MoEOptions o;
  o.router.experts = experts;
  o.router.top_k = top_k;
  o.router.score_func = "softmax";
  o.router.norm_topk_prob = norm_topk_prob;
  o.router.expert_bias = load_balance_rate > 0;
  o.hidden = expert_hidden;
  o.capacity_factor = capacity_factor;
  o.aux_loss_coeff = aux_loss_coeff;
  o.seq_aux_loss_coeff = seq_aux_loss_coeff;
  o.z_loss_coeff = z_loss_coeff;
  o.capacity_policy = nn::capacity_policy_named(capacity_policy).value_or(nn::CapacityPolicy::kError);
  return o;
}

int64_t Qwen3MoeConfig::moe_parameters() const { return experts * llama.dim + experts * 3 * llama.dim * expert_hidden; }

int64_t Qwen3MoeConfig::active_moe_parameters() const {
  return experts * llama.dim + top_k * 3 * llama.dim * expert_hidden;
}

void Qwen3MoeConfig::validate() const {
  llama.validate();
  HP_CHECK(experts > 0 && expert_hidden > 0, "model: experts (", experts, ") and expert_hidden (", expert_hidden,
           ") must be positive");
  HP_CHECK(load_balance_rate >= 0 && load_balance_rate < 1, "model: load_balance_rate (", load_balance_rate,
           ") must be in [0, 1)");
  HP_CHECK(capacity_factor >= 0 && capacity_factor < 1e6, "model: capacity_factor (", capacity_factor,
           ") must be in [0, 1e6); 0 is dropless");
  HP_CHECK(nn::capacity_policy_named(capacity_policy).has_value(), "model: capacity_policy '", capacity_policy,
           "' is unknown (error, drop_lowest, drop_last)");
  for (const double coeff : {aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff})
    HP_CHECK(coeff >= 0 && coeff < 1e6, "model: aux_loss_coeff, seq_aux_loss_coeff and z_loss_coeff must be in ",
             "[0, 1e6), got ", coeff);
  HP_CHECK(top_k >= 1 && top_k <= experts, "model: top_k (", top_k, ") must be between 1 and experts (", experts, ")");
  // Every layer's experts, summed over the layers, must fit with room to spare (sizes come from files).
  const int64_t limit = int64_t{1} << 58;
  HP_CHECK(checked_product({llama.layers, experts, 3, llama.dim, expert_hidden}).value_or(limit) < limit,
           "model: sizes too large (layers ", llama.layers, ", experts ", experts, ", dim ", llama.dim,
           ", expert_hidden ", expert_hidden, "): the parameter count would overflow 64 bits");
}

Qwen3MoeConfig qwen3_30b_a3b() {
  Qwen3MoeConfig c;
  c.llama = {151936, 2048, 48, 32, 4, /*ffn_hidden (unused)=*/6144, 40960, 1e6, 1e-6, true, false, /*head_dim=*/128};
  c.experts = 128;
  c.top_k = 8;
  c.expert_hidden = 768;
  return c;
}

Qwen3MoeConfig qwen3_235b_a22b() {
  Qwen3MoeConfig c;
  c.llama = {151936, 4096, 94, 64, 4, /*ffn_hidden (unused)=*/12288, 40960, 1e6, 1e-6, true, false, /*head_dim=*/128};
  c.experts = 128;
  c.top_k = 8;
  c.expert_hidden = 1536;
  return c;
}

std::shared_ptr<Llama> make_qwen3_moe(const Qwen3MoeConfig& config) {
  config.validate();
  const nn::MoEOptions options = config.moe_options();
  const int64_t dim = config.llama.dim;
  return std::make_shared<Llama>(config.llama, [&](int64_t) { return std::make_shared<nn::MoE>(dim, options); });
}

}  // namespace hp::models
