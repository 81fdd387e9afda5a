// Llama / Qwen3-style dense decoder, written once against hp::nn with no parallel code: GQA
// attention with rotary embeddings (optional QK-norm, as Qwen3), SwiGLU MLP, RMSNorm, residuals,
// embedding and LM head (optionally tied to the embedding). Parallelism is applied from outside
// (hp/models/parallelize.h). Heads are reshaped with -1, so the same code runs on tensor-parallel
// local shards.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "hp/nn/layers.h"

namespace hp::models {

struct LlamaConfig {
  int64_t vocab = 64;
  int64_t dim = 32;
  int64_t layers = 2;
  int64_t heads = 8;
  int64_t kv_heads = 4;
  int64_t ffn_hidden = 48;
  int64_t max_seq = 32;      // longest sequence (rotary tables are built for it)
  double rope_theta = 10000.0;
  double norm_eps = 1e-6;
  bool qk_norm = false;      // RMSNorm over each head of q and k before RoPE (Qwen3)
  bool tie_embeddings = false;  // the LM head reuses the embedding matrix
  int64_t head_dim() const { return dim / heads; }
  int64_t parameter_count() const;
  // Throws hp::Error naming the first inconsistent field (dim % heads, heads % kv_heads, odd head_dim, ...).
  void validate() const;
};

class Attention : public nn::Module {
 public:
  explicit Attention(const LlamaConfig& c);
  std::shared_ptr<nn::Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<nn::RMSNorm> q_norm, k_norm;  // null without qk_norm

 protected:
  at::Tensor forward(const at::Tensor& x) override;

 private:
  at::Tensor rotate(const at::Tensor& t) const;
  int64_t head_dim_;
  at::Tensor cos_, sin_;
};

class Mlp : public nn::Module {
 public:
  explicit Mlp(const LlamaConfig& c);
  std::shared_ptr<nn::Linear> gate, up, down;

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

class Block : public nn::Module {
 public:
  explicit Block(const LlamaConfig& c);
  std::shared_ptr<nn::RMSNorm> attn_norm;
  std::shared_ptr<Attention> attn;
  std::shared_ptr<nn::RMSNorm> mlp_norm;
  std::shared_ptr<Mlp> mlp;

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

// tokens [batch, seq] (int64) -> logits [batch, seq, vocab].
class Llama : public nn::Module {
 public:
  explicit Llama(const LlamaConfig& c);
  const LlamaConfig& config() const { return config_; }
  std::shared_ptr<nn::Embedding> embed;
  std::shared_ptr<nn::Sequential> layers;
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<nn::Linear> output;  // null with tie_embeddings

 protected:
  at::Tensor forward(const at::Tensor& tokens) override;

 private:
  LlamaConfig config_;
};

// Hugging Face Llama / Qwen3 names of our parameters ("layers.3.attn.q_proj.weight" <->
// "model.layers.3.self_attn.q_proj.weight", "embed.weight" <-> "model.embed_tokens.weight", ...).
// Our rotary embedding uses HF's rotate_half layout, so q/k weights map without permutation.
// Unknown names give "".
std::string llama_to_hf_name(const std::string& fqn);
std::string llama_from_hf_name(const std::string& hf_name);

// Greedy continuation of `prompt` (1-D int64) by `new_tokens` tokens, the context cropped to
// max_seq. Collective when the model is parallelized: every rank calls it with the same prompt.
at::Tensor generate_greedy(Llama& model, const at::Tensor& prompt, int64_t new_tokens);
// The same with any function from tokens [1, seq] to logits [1, seq, vocab] (e.g. a pipeline's
// forward), the context cropped to `max_seq`.
at::Tensor generate_greedy(const std::function<at::Tensor(const at::Tensor&)>& logits_of, const at::Tensor& prompt,
                           int64_t new_tokens, int64_t max_seq);

}  // namespace hp::models
