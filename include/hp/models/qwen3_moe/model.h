// Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Llama decoder with QK-norm attention, GQA and an
// explicit head size, where every layer's MLP is a mixture of experts (softmax top-k routing with
// the k gate values renormalized, no shared experts). Written with no parallel code: the blocks
// are hp::models::Block with an hp::nn::MoE as their "mlp"; expert parallelism and FSDP are
// applied from outside (hp/models/qwen3_moe/parallelize.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "hp/models/llama/model.h"
#include "hp/nn/moe.h"

namespace hp::models {

struct Qwen3MoeConfig {
  // Embeddings, attention and norms; llama.ffn_hidden is not used (each layer's MLP is the MoE).
  LlamaConfig llama = default_attention();
  int64_t experts = 8;
  int64_t top_k = 2;
  int64_t expert_hidden = 32;  // each expert's hidden size (HF: moe_intermediate_size)
  bool norm_topk_prob = true;  // the k gate values sum to 1
  // > 0: auxiliary-loss-free load balancing. Each router gets an expert bias (used only to choose
  // experts) that every step moves by this much toward balance (hp::nn::balance_experts).
  double load_balance_rate = 0.0;
  // > 0: each expert takes at most ceil(capacity_factor * tokens * top_k / experts) rows of a
  // rank's micro-batch; the rest: "error" (stop, naming the rank and expert), "drop_lowest" (the
  // lowest gate values) or "drop_last" (the last tokens). 0: dropless (Qwen3's own setting).
  double capacity_factor = 0.0;
  std::string capacity_policy = "error";
  // Auxiliary loss coefficients (hp::nn::MoEOptions; 0: off). Qwen3-MoE trains with aux_loss_coeff
  // 0.001 (HF router_aux_loss_coef).
  double aux_loss_coeff = 0.0;
  double seq_aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;

  nn::MoEOptions moe_options() const;
  // Per layer: the router and every expert.
  int64_t moe_parameters() const;
  // Per token and layer: the router and the top_k experts it runs.
  int64_t active_moe_parameters() const;
  int64_t parameter_count() const { return llama.parameter_count(moe_parameters()); }
  // The parameters one token's forward touches (the published "active" count).
  int64_t active_parameter_count() const { return llama.parameter_count(active_moe_parameters()); }
  double flops_per_token(int64_t seq) const { return llama.flops_per_token(seq, active_moe_parameters()); }
  // Throws hp::Error naming the first inconsistent field.
  void validate() const;

  static LlamaConfig default_attention();  // tiny, with qk_norm
};

// The published shapes (HF config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B).
Qwen3MoeConfig qwen3_30b_a3b();
Qwen3MoeConfig qwen3_235b_a22b();

// The model: a Llama whose blocks' "mlp" is an hp::nn::MoE.
std::shared_ptr<Llama> make_qwen3_moe(const Qwen3MoeConfig& config);

}  // namespace hp::models
