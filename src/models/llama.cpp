#include "hp/models/llama.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"

namespace hp::models {

int64_t LlamaConfig::parameter_count() const {
  const int64_t attention = dim * heads * head_dim() * 2 + dim * kv_heads * head_dim() * 2 + (qk_norm ? 2 * head_dim() : 0);
  const int64_t block = attention + 3 * dim * ffn_hidden + 2 * dim;
  return vocab * dim * (tie_embeddings ? 1 : 2) + layers * block + dim;
}

void LlamaConfig::validate() const {
  HP_CHECK(vocab > 0 && dim > 0 && layers > 0 && heads > 0 && kv_heads > 0 && ffn_hidden > 0 && max_seq > 0,
           "model: vocab, dim, layers, heads, kv_heads, ffn_hidden and max_seq must be positive");
  HP_CHECK(dim % heads == 0, "model: dim ", dim, " is not divisible by heads ", heads);
  HP_CHECK(heads % kv_heads == 0, "model: heads ", heads, " is not divisible by kv_heads ", kv_heads);
  HP_CHECK(head_dim() % 2 == 0, "model: head dim ", head_dim(), " (dim / heads) must be even for rotary embeddings");
}

Attention::Attention(const LlamaConfig& c)
    : nn::Module("Attention"),
      q_proj(add_module("q_proj", std::make_shared<nn::Linear>(c.dim, c.heads * c.head_dim(), false))),
      k_proj(add_module("k_proj", std::make_shared<nn::Linear>(c.dim, c.kv_heads * c.head_dim(), false))),
      v_proj(add_module("v_proj", std::make_shared<nn::Linear>(c.dim, c.kv_heads * c.head_dim(), false))),
      o_proj(add_module("o_proj", std::make_shared<nn::Linear>(c.heads * c.head_dim(), c.dim, false))),
      head_dim_(c.head_dim()) {
  if (c.qk_norm) {
    q_norm = add_module("q_norm", std::make_shared<nn::RMSNorm>(head_dim_, c.norm_eps));
    k_norm = add_module("k_norm", std::make_shared<nn::RMSNorm>(head_dim_, c.norm_eps));
  }
  // Rotary tables [max_seq, head_dim]: angle t * theta^(-2i/head_dim), each frequency twice.
  const at::Tensor inv_freq = at::pow(c.rope_theta, -at::arange(0, head_dim_, 2, at::kDouble) / head_dim_);
  const at::Tensor angles = at::outer(at::arange(c.max_seq, at::kDouble), inv_freq).repeat({1, 2});
  cos_ = angles.cos().to(at::kFloat);
  sin_ = angles.sin().to(at::kFloat);
}

at::Tensor Attention::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1);
  HP_CHECK(s <= cos_.size(0), "Llama: sequence length ", s, " exceeds max_seq ", cos_.size(0));
  at::Tensor q = (*q_proj)(x).view({b, s, -1, head_dim_});
  at::Tensor k = (*k_proj)(x).view({b, s, -1, head_dim_});
  const at::Tensor v = (*v_proj)(x).view({b, s, -1, head_dim_}).transpose(1, 2);
  if (q_norm) {
    q = (*q_norm)(q);
    k = (*k_norm)(k);
  }
  q = rotate(q).transpose(1, 2);  // [b, heads, s, head_dim]
  k = rotate(k).transpose(1, 2);
  const int64_t repeat = q.size(1) / k.size(1);  // grouped-query attention
  auto expand_kv = [&](const at::Tensor& t) {
    return t.unsqueeze(2).expand({b, t.size(1), repeat, s, head_dim_}).reshape({b, -1, s, head_dim_});
  };
  const at::Tensor causal = at::ones({s, s}, at::kBool).triu(1);
  const at::Tensor scores = at::matmul(q, expand_kv(k).transpose(-2, -1))
                                .div(std::sqrt(static_cast<double>(head_dim_)))
                                .masked_fill(causal, -INFINITY);
  const at::Tensor out = at::matmul(at::softmax(scores, -1), expand_kv(v));
  return (*o_proj)(out.transpose(1, 2).reshape({b, s, -1}));
}

at::Tensor Attention::rotate(const at::Tensor& t) const {  // t: [b, s, heads, head_dim]
  const int64_t s = t.size(1), half = head_dim_ / 2;
  // In t's dtype, so that bf16 activations stay bf16.
  const at::Tensor cos = cos_.narrow(0, 0, s).view({1, s, 1, head_dim_}).to(t.scalar_type());
  const at::Tensor sin = sin_.narrow(0, 0, s).view({1, s, 1, head_dim_}).to(t.scalar_type());
  const at::Tensor rotated = at::cat({-t.narrow(-1, half, half), t.narrow(-1, 0, half)}, -1);
  return t * cos + rotated * sin;
}

Mlp::Mlp(const LlamaConfig& c)
    : nn::Module("Mlp"),
      gate(add_module("gate", std::make_shared<nn::Linear>(c.dim, c.ffn_hidden, false))),
      up(add_module("up", std::make_shared<nn::Linear>(c.dim, c.ffn_hidden, false))),
      down(add_module("down", std::make_shared<nn::Linear>(c.ffn_hidden, c.dim, false))) {}

at::Tensor Mlp::forward(const at::Tensor& x) { return (*down)(at::silu((*gate)(x)) * (*up)(x)); }

Block::Block(const LlamaConfig& c)
    : nn::Module("Block"),
      attn_norm(add_module("attn_norm", std::make_shared<nn::RMSNorm>(c.dim, c.norm_eps))),
      attn(add_module("attn", std::make_shared<Attention>(c))),
      mlp_norm(add_module("mlp_norm", std::make_shared<nn::RMSNorm>(c.dim, c.norm_eps))),
      mlp(add_module("mlp", std::make_shared<Mlp>(c))) {}

at::Tensor Block::forward(const at::Tensor& x) {
  const at::Tensor h = x + (*attn)((*attn_norm)(x));
  return h + (*mlp)((*mlp_norm)(h));
}

Llama::Llama(const LlamaConfig& c)
    : nn::Module("Llama"),
      embed(add_module("embed", std::make_shared<nn::Embedding>(c.vocab, c.dim))),
      layers(add_module("layers", std::make_shared<nn::Sequential>())),
      norm(add_module("norm", std::make_shared<nn::RMSNorm>(c.dim, c.norm_eps))),
      config_(c) {
  c.validate();
  for (int64_t i = 0; i < c.layers; ++i) layers->push_back(std::make_shared<Block>(c));
  if (!c.tie_embeddings) output = add_module("output", std::make_shared<nn::Linear>(c.dim, c.vocab, false));
  embed->set_param_init("weight", nn::Init::normal(0.0, 0.5));
}

at::Tensor Llama::forward(const at::Tensor& tokens) {
  const at::Tensor h = (*norm)((*layers)((*embed)(tokens)));
  return output ? (*output)(h) : at::linear(h, embed->param("weight"));
}

namespace {

// Our module path -> HF's, per segment after "layers.N." (or at the top level).
const std::vector<std::pair<std::string, std::string>>& hf_table() {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"attn.q_proj", "self_attn.q_proj"}, {"attn.k_proj", "self_attn.k_proj"}, {"attn.v_proj", "self_attn.v_proj"},
      {"attn.o_proj", "self_attn.o_proj"}, {"attn.q_norm", "self_attn.q_norm"}, {"attn.k_norm", "self_attn.k_norm"},
      {"attn_norm", "input_layernorm"},    {"mlp_norm", "post_attention_layernorm"},
      {"mlp.gate", "mlp.gate_proj"},       {"mlp.up", "mlp.up_proj"},         {"mlp.down", "mlp.down_proj"}};
  return table;
}

const std::vector<std::pair<std::string, std::string>>& hf_top_table() {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"embed.weight", "model.embed_tokens.weight"}, {"norm.weight", "model.norm.weight"}, {"output.weight", "lm_head.weight"}};
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

at::Tensor generate_greedy(const std::function<at::Tensor(const at::Tensor&)>& logits_of, const at::Tensor& prompt,
                           int64_t new_tokens, int64_t max_seq) {
  HP_CHECK(prompt.dim() == 1 && prompt.scalar_type() == at::kLong && prompt.numel() > 0,
           "generate_greedy: the prompt must be a non-empty 1-D int64 tensor");
  torch::NoGradGuard no_grad;
  at::Tensor tokens = prompt.clone();
  for (int64_t i = 0; i < new_tokens; ++i) {
    const int64_t n = tokens.size(0), keep = std::min(n, max_seq);
    at::Tensor logits = logits_of(tokens.narrow(0, n - keep, keep).unsqueeze(0));
    if (is_dtensor(logits)) logits = DTensor(logits).full_tensor();
    tokens = at::cat({tokens, logits[0][keep - 1].argmax().view({1})});
  }
  return tokens;
}

at::Tensor generate_greedy(Llama& model, const at::Tensor& prompt, int64_t new_tokens) {
  return generate_greedy([&](const at::Tensor& tokens) { return model(tokens); }, prompt, new_tokens,
                         model.config().max_seq);
}

}  // namespace hp::models
