// Llama / Qwen3-style dense decoder, written once against hp::nn with no parallel code: GQA
// attention with rotary embeddings (optional QK-norm, as Qwen3), SwiGLU MLP, RMSNorm, residuals,
// embedding and LM head (optionally tied to the embedding). Parallelism is applied from outside
// (hp/models/llama/parallelize.h). Heads are reshaped with -1, so the same code runs on tensor-parallel
// local shards.
#pragma once

#include <cstdint>
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
  int64_t max_seq = 32;  // longest sequence (rotary tables are built for it)
  double rope_theta = 10000.0;
  double norm_eps = 1e-6;
  bool qk_norm = false;         // RMSNorm over each head of q and k before RoPE (Qwen3)
  bool tie_embeddings = false;  // the LM head reuses the embedding matrix
  int64_t head_dim() const { return dim / heads; }
  int64_t parameter_count() const;
  // Training FLOPs per token at sequence length `seq`: 6 per matmul weight (forward + backward)
  // plus attention's scores and mixing.
  double flops_per_token(int64_t seq) const;
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

}  // namespace hp::models
