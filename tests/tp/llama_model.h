// A small Llama-style decoder written once against hp::nn, with no parallel code: GQA attention
// with rotary embeddings, SwiGLU MLP, RMSNorm, residuals, embedding and LM head. Tests apply
// tensor-parallel plans to it from outside. Heads are reshaped with -1 so the same code runs on
// tensor-parallel local shards.
#pragma once

#include <ATen/ATen.h>
#include <hp/nn/layers.h>

#include <cmath>
#include <memory>

namespace hp::test {

struct LlamaConfig {
  int64_t vocab = 64;
  int64_t dim = 32;
  int64_t layers = 2;
  int64_t heads = 8;
  int64_t kv_heads = 4;
  int64_t ffn_hidden = 48;
  int64_t max_seq = 32;
  double rope_theta = 10000.0;
  int64_t head_dim() const { return dim / heads; }
};

class Attention : public nn::Module {
 public:
  explicit Attention(const LlamaConfig& c)
      : nn::Module("Attention"),
        head_dim_(c.head_dim()),
        q_proj(add_module("q_proj", std::make_shared<nn::Linear>(c.dim, c.heads * c.head_dim(), false))),
        k_proj(add_module("k_proj", std::make_shared<nn::Linear>(c.dim, c.kv_heads * c.head_dim(), false))),
        v_proj(add_module("v_proj", std::make_shared<nn::Linear>(c.dim, c.kv_heads * c.head_dim(), false))),
        o_proj(add_module("o_proj", std::make_shared<nn::Linear>(c.heads * c.head_dim(), c.dim, false))) {
    // Rotary tables [max_seq, head_dim]: angle t * theta^(-2i/head_dim), each frequency twice.
    const at::Tensor inv_freq = at::pow(c.rope_theta, -at::arange(0, head_dim_, 2, at::kDouble) / head_dim_);
    const at::Tensor angles = at::outer(at::arange(c.max_seq, at::kDouble), inv_freq).repeat({1, 2});
    cos_ = angles.cos().to(at::kFloat);
    sin_ = angles.sin().to(at::kFloat);
  }

 protected:
  at::Tensor forward(const at::Tensor& x) override {
    const int64_t b = x.size(0), s = x.size(1);
    at::Tensor q = (*q_proj)(x).view({b, s, -1, head_dim_});
    at::Tensor k = (*k_proj)(x).view({b, s, -1, head_dim_});
    const at::Tensor v = (*v_proj)(x).view({b, s, -1, head_dim_}).transpose(1, 2);
    q = rotate(q).transpose(1, 2);  // [b, heads, s, head_dim]
    k = rotate(k).transpose(1, 2);
    const int64_t repeat = q.size(1) / k.size(1);  // grouped-query attention
    auto expand_kv = [&](const at::Tensor& t) {
      return t.unsqueeze(2).expand({b, t.size(1), repeat, s, head_dim_}).reshape({b, -1, s, head_dim_});
    };
    const at::Tensor causal = at::ones({s, s}, at::kBool).triu(1);
    const at::Tensor scores =
        at::matmul(q, expand_kv(k).transpose(-2, -1)).div(std::sqrt(static_cast<double>(head_dim_))).masked_fill(causal, -INFINITY);
    const at::Tensor out = at::matmul(at::softmax(scores, -1), expand_kv(v));
    return (*o_proj)(out.transpose(1, 2).reshape({b, s, -1}));
  }

 private:
  at::Tensor rotate(const at::Tensor& t) const {  // t: [b, s, heads, head_dim]
    const int64_t s = t.size(1), half = head_dim_ / 2;
    // In t's dtype, so that bf16 activations stay bf16.
    const at::Tensor cos = cos_.narrow(0, 0, s).view({1, s, 1, head_dim_}).to(t.scalar_type());
    const at::Tensor sin = sin_.narrow(0, 0, s).view({1, s, 1, head_dim_}).to(t.scalar_type());
    const at::Tensor rotated = at::cat({-t.narrow(-1, half, half), t.narrow(-1, 0, half)}, -1);
    return t * cos + rotated * sin;
  }

  int64_t head_dim_;
  at::Tensor cos_, sin_;

 public:
  std::shared_ptr<nn::Linear> q_proj, k_proj, v_proj, o_proj;
};

class Mlp : public nn::Module {
 public:
  explicit Mlp(const LlamaConfig& c)
      : nn::Module("Mlp"),
        gate(add_module("gate", std::make_shared<nn::Linear>(c.dim, c.ffn_hidden, false))),
        up(add_module("up", std::make_shared<nn::Linear>(c.dim, c.ffn_hidden, false))),
        down(add_module("down", std::make_shared<nn::Linear>(c.ffn_hidden, c.dim, false))) {}
  std::shared_ptr<nn::Linear> gate, up, down;

 protected:
  at::Tensor forward(const at::Tensor& x) override { return (*down)(at::silu((*gate)(x)) * (*up)(x)); }
};

class Block : public nn::Module {
 public:
  explicit Block(const LlamaConfig& c)
      : nn::Module("Block"),
        attn_norm(add_module("attn_norm", std::make_shared<nn::RMSNorm>(c.dim))),
        attn(add_module("attn", std::make_shared<Attention>(c))),
        mlp_norm(add_module("mlp_norm", std::make_shared<nn::RMSNorm>(c.dim))),
        mlp(add_module("mlp", std::make_shared<Mlp>(c))) {}
  std::shared_ptr<nn::RMSNorm> attn_norm;
  std::shared_ptr<Attention> attn;
  std::shared_ptr<nn::RMSNorm> mlp_norm;
  std::shared_ptr<Mlp> mlp;

 protected:
  at::Tensor forward(const at::Tensor& x) override {
    const at::Tensor h = x + (*attn)((*attn_norm)(x));
    return h + (*mlp)((*mlp_norm)(h));
  }
};

class Llama : public nn::Module {
 public:
  explicit Llama(const LlamaConfig& c)
      : nn::Module("Llama"),
        embed(add_module("embed", std::make_shared<nn::Embedding>(c.vocab, c.dim))),
        layers(add_module("layers", std::make_shared<nn::Sequential>())),
        norm(add_module("norm", std::make_shared<nn::RMSNorm>(c.dim))),
        output(add_module("output", std::make_shared<nn::Linear>(c.dim, c.vocab, false))) {
    for (int64_t i = 0; i < c.layers; ++i) layers->push_back(std::make_shared<Block>(c));
    embed->set_param_init("weight", nn::Init::normal(0.0, 0.5));
  }
  std::shared_ptr<nn::Embedding> embed;
  std::shared_ptr<nn::Sequential> layers;
  std::shared_ptr<nn::RMSNorm> norm;
  std::shared_ptr<nn::Linear> output;

 protected:
  at::Tensor forward(const at::Tensor& tokens) override { return (*output)((*norm)((*layers)((*embed)(tokens)))); }
};

}  // namespace hp::test
