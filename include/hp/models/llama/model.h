// Llama / Qwen3-style dense decoder, written once against hp::nn with no parallel code: GQA
// attention with rotary embeddings (optional QK-norm, as Qwen3), SwiGLU MLP, RMSNorm, residuals,
// embedding and LM head (optionally tied to the embedding). Parallelism is applied from outside
// (hp/models/llama/parallelize.h). Heads are reshaped with -1, so the same code runs on tensor-parallel
// local shards.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "hp/nn/attention.h"
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
  // Each head's size; 0: dim / heads. Qwen3 sets it apart (128 at dim 2048 and 32 heads). Last, so
  // that positional initializers of the fields above keep their meaning.
  int64_t head_dim = 0;
  // Residual dropout: on the attention's and the MLP's outputs before each joins the residual
  // stream (GPT-2's resid_pdrop), in training only. Masks by global position (hp::nn::Dropout).
  double residual_dropout = 0.0;
  // Dropout on the attention probabilities (Hugging Face's attention_dropout), in training only.
  double attention_dropout = 0.0;
  int64_t head_size() const { return head_dim > 0 ? head_dim : dim / heads; }
  int64_t parameter_count() const { return parameter_count(3 * dim * ffn_hidden); }
  // With each layer's MLP replaced by a feed-forward module of `ffn_parameters` parameters.
  int64_t parameter_count(int64_t ffn_parameters) const;
  // Training FLOPs per token at sequence length `seq`: 6 per matmul weight (forward + backward)
  // plus attention's scores and mixing.
  double flops_per_token(int64_t seq) const { return flops_per_token(seq, 3 * dim * ffn_hidden); }
  // With each layer's MLP replaced by one whose matmuls touch `ffn_parameters` weights per token
  // (a mixture of experts' active parameters).
  double flops_per_token(int64_t seq, int64_t ffn_parameters) const;
  // Throws hp::Error naming the first inconsistent field (dim % heads, heads % kv_heads, odd head_dim, ...).
  void validate() const;
};

class Attention : public nn::Module {
 public:
  explicit Attention(const LlamaConfig& c);
  std::shared_ptr<nn::Linear> q_proj, k_proj, v_proj, o_proj;
  std::shared_ptr<nn::RMSNorm> q_norm, k_norm;  // null without qk_norm
  // softmax(q k^T / sqrt(head_dim), causal) v; says where this rank's tokens are (RoPE's positions).
  std::shared_ptr<nn::CoreAttention> core;

 protected:
  at::Tensor forward(const at::Tensor& x) override;

 private:
  // The rotary embedding of the tokens at `positions` for tensors like t ([b, s, heads, head_dim]):
  // the rows of the tables, gathered once for k and q (a context-parallel shard's are not a slice of
  // the tables).
  struct Rotation {
    at::Tensor cos, sin;
    bool composed = false;  // off the host: ATen's ops on the device tables, not the fused kernel
  };
  Rotation rotation(const at::Tensor& t, const at::Tensor& positions) const;
  static at::Tensor rotate(const at::Tensor& t, const Rotation& rotation);
  // The tables' rows for `positions` as [1, s, 1, head_dim], on t's device in t's dtype.
  std::pair<at::Tensor, at::Tensor> rotary_rows(const at::Tensor& t, const at::Tensor& positions) const;
  int64_t head_dim_;
  double rope_theta_;
  at::Tensor cos_, sin_;  // rotary tables on the host, fp32, shared by the layers
  // Off the host, the whole tables on t's device in t's dtype, found by the first forward there (a
  // sequence's rows are then a slice or a gather on the device, not a copy from the host per call).
  mutable at::Tensor device_cos_, device_sin_;
};

class Mlp : public nn::Module {
 public:
  explicit Mlp(const LlamaConfig& c);
  std::shared_ptr<nn::Linear> gate, up, down;

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

// x + attn(norm(x)), then h + mlp(norm(h)), each branch through its residual dropout when the
// config has one; `mlp` is the dense Mlp unless the block is given another feed-forward module
// ([..., dim] -> [..., dim]), such as a mixture of experts.
class Block : public nn::Module {
 public:
  explicit Block(const LlamaConfig& c, std::shared_ptr<nn::Module> ffn = nullptr);
  std::shared_ptr<nn::RMSNorm> attn_norm;
  std::shared_ptr<Attention> attn;
  std::shared_ptr<nn::RMSNorm> mlp_norm;
  std::shared_ptr<nn::Module> mlp;
  std::shared_ptr<nn::Dropout> attn_out_dropout, mlp_out_dropout;  // null without residual_dropout

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

// The feed-forward module of layer `layer` (a family that replaces the dense MLP, e.g. with a
// mixture of experts); null keeps the dense Mlp.
using FfnFactory = std::function<std::shared_ptr<nn::Module>(int64_t layer)>;

// tokens [batch, seq] (int64) -> logits [batch, seq, vocab].
class Llama : public nn::Module {
 public:
  explicit Llama(const LlamaConfig& c, const FfnFactory& ffn = nullptr);
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
