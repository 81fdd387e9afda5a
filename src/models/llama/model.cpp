#include "hp/models/llama/model.h"

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "hp/core/checked_size.h"
#include "hp/core/error.h"
#include "hp/kernels/rope.h"
#include "hp/kernels/swiglu.h"

namespace hp::models {

int64_t LlamaConfig::parameter_count(int64_t ffn_parameters) const {
  const int64_t attention =
      dim * heads * head_size() * 2 + dim * kv_heads * head_size() * 2 + (qk_norm ? 2 * head_size() : 0);
  const int64_t block = attention + ffn_parameters + 2 * dim;
  return vocab * dim * (tie_embeddings ? 1 : 2) + layers * block + dim;
}

double LlamaConfig::flops_per_token(int64_t seq, int64_t ffn_parameters) const {
  // Every weight but the embedding's lookup is a matmul (a tied head is one).
  const double matmul_params =
      static_cast<double>(parameter_count(ffn_parameters) - vocab * dim * (tie_embeddings ? 0 : 1));
  return 6.0 * matmul_params + 12.0 * static_cast<double>(layers * heads * head_size() * seq);
}

void LlamaConfig::validate() const {
  HP_CHECK(vocab > 0 && dim > 0 && layers > 0 && heads > 0 && kv_heads > 0 && ffn_hidden > 0 && max_seq > 0,
           "model: vocab, dim, layers, heads, kv_heads, ffn_hidden and max_seq must be positive");
  HP_CHECK(head_dim >= 0, "model: head_dim must be positive, or 0 for dim / heads; got ", head_dim);
  // Sizes from a config file: every term of the parameter count (attention's four projections,
  // the MLP's three per layer) must fit, with room for their sum, so no size arithmetic wraps.
  const int64_t limit = int64_t{1} << 58;
  for (const std::vector<int64_t>& term : std::vector<std::vector<int64_t>>{{vocab, dim, 2},
                                                                            {layers, dim, heads, head_size(), 4},
                                                                            {layers, dim, ffn_hidden, 3},
                                                                            {max_seq, dim},
                                                                            {max_seq, head_size()}})
    HP_CHECK(checked_product(term).value_or(limit) < limit, "model: sizes too large (vocab ", vocab, ", dim ", dim,
             ", layers ", layers, ", ffn_hidden ", ffn_hidden, ", max_seq ", max_seq, ", head_dim ", head_dim,
             "): the parameter count would overflow 64 bits");
  HP_CHECK(std::isfinite(rope_theta) && rope_theta > 0.0, "model: rope_theta must be a positive number, got ",
           rope_theta);
  HP_CHECK(head_dim > 0 || dim % heads == 0, "model: dim ", dim, " is not divisible by heads ", heads,
           " (or set model.head_dim)");
  for (const auto& [name, p] :
       {std::pair<const char*, double>{"residual_dropout", residual_dropout}, {"attention_dropout", attention_dropout}})
    HP_CHECK(p >= 0.0 && p < 1.0, "model: ", name, " must be in [0, 1); got ", p);
  HP_CHECK(heads % kv_heads == 0, "model: heads ", heads, " is not divisible by kv_heads ", kv_heads);
  HP_CHECK(head_size() % 2 == 0, "model: the head size ", head_size(), " must be even for rotary embeddings");
}

namespace {

// Rotary tables [max_seq, head_dim] (cos, sin): angle t * theta^(-2i/head_dim), each frequency
// twice; on `device` in `dtype`. Made once and shared by every layer (of every model) while any
// holds them: a copy per layer kept layers x 2 x max_seq x head_dim floats (640 MB for 80 layers
// of max_seq 8192, on the host and again on a device), and its temporaries made a dry run's build
// of such a model take gigabytes. Off the host they are made from `host` (the host tables).
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t max_seq, int64_t head_dim, double theta, c10::Device device,
                                                at::ScalarType dtype,
                                                const std::pair<at::Tensor, at::Tensor>& host = {}) {
  using Key = std::tuple<int64_t, int64_t, double, std::string, int>;
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  static std::mutex mu;
  static std::map<Key, std::pair<Weak, Weak>> made;
  const Key key{max_seq, head_dim, theta, device.str(), static_cast<int>(dtype)};
  const auto live = [&]() -> std::optional<std::pair<at::Tensor, at::Tensor>> {  // under mu
    if (const auto it = made.find(key); it != made.end()) {
      auto cos = it->second.first.lock(), sin = it->second.second.lock();
      if (cos && sin) return std::make_pair(at::Tensor(std::move(cos)), at::Tensor(std::move(sin)));
    }
    return std::nullopt;
  };
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (auto found = live()) return *found;
  }
  std::pair<at::Tensor, at::Tensor> tables;
  if (device.is_cpu() && dtype == at::kFloat) {
    const at::Tensor inv_freq = at::pow(theta, -at::arange(0, head_dim, 2, at::kDouble) / head_dim);
    const at::Tensor angles = at::outer(at::arange(max_seq, at::kDouble), inv_freq).repeat({1, 2});
    tables = {angles.cos().to(at::kFloat), angles.sin().to(at::kFloat)};
  } else {
    HP_CHECK(host.first.defined(), "rotary tables off the host are made from the host's");
    tables = {host.first.to(device, dtype), host.second.to(device, dtype)};
  }
  const std::lock_guard<std::mutex> lock(mu);
  if (auto found = live()) return *found;          // another thread made them meanwhile
  for (auto it = made.begin(); it != made.end();)  // what no model holds any more
    it = it->second.first.expired() ? made.erase(it) : std::next(it);
  made.insert_or_assign(key,
                        std::make_pair(Weak(tables.first.getIntrusivePtr()), Weak(tables.second.getIntrusivePtr())));
  return tables;
}

}  // namespace

Attention::Attention(const LlamaConfig& c)
    : nn::Module("Attention"),
      q_proj(add_module("q_proj", std::make_shared<nn::Linear>(c.dim, c.heads * c.head_size(), false))),
      k_proj(add_module("k_proj", std::make_shared<nn::Linear>(c.dim, c.kv_heads * c.head_size(), false))),
      v_proj(add_module("v_proj", std::make_shared<nn::Linear>(c.dim, c.kv_heads * c.head_size(), false))),
      o_proj(add_module("o_proj", std::make_shared<nn::Linear>(c.heads * c.head_size(), c.dim, false))),
      core(add_module(
          "core", std::make_shared<nn::CoreAttention>(/*causal=*/true, /*scale=*/0.0, c.attention_dropout, c.heads))),
      head_dim_(c.head_size()),
      rope_theta_(c.rope_theta) {
  if (c.qk_norm) {
    q_norm = add_module("q_norm", std::make_shared<nn::RMSNorm>(head_dim_, c.norm_eps));
    k_norm = add_module("k_norm", std::make_shared<nn::RMSNorm>(head_dim_, c.norm_eps));
  }
  std::tie(cos_, sin_) = rotary_tables(c.max_seq, head_dim_, c.rope_theta, c10::kCPU, at::kFloat);
}

at::Tensor Attention::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1);
  const at::Tensor positions = core->positions(s);
  const int64_t last = s == 0 ? -1 : positions.max().item<int64_t>();
  HP_CHECK(last < cos_.size(0), "Llama: sequence length ", last + 1, " exceeds max_seq ", cos_.size(0));
  // Keys and values first, handed to the core as soon as they exist: a context-parallel plan can
  // start moving them between ranks while the queries are computed.
  at::Tensor k = (*k_proj)(x).view({b, s, -1, head_dim_});
  if (k_norm) k = (*k_norm)(k);
  const Rotation rotary = rotation(k, positions);
  k = rotate(k, rotary).transpose(1, 2);  // [b, heads, s, head_dim]
  const at::Tensor v = (*v_proj)(x).view({b, s, -1, head_dim_}).transpose(1, 2);
  core->begin(k, v);
  at::Tensor q = (*q_proj)(x).view({b, s, -1, head_dim_});
  if (q_norm) q = (*q_norm)(q);
  q = rotate(q, rotary).transpose(1, 2);
  const at::Tensor out = core->call({q, k, v});
  return (*o_proj)(out.transpose(1, 2).reshape({b, s, -1}));
}

std::pair<at::Tensor, at::Tensor> Attention::rotary_rows(const at::Tensor& t, const at::Tensor& positions) const {
  const int64_t s = t.size(1);
  const auto rows = [&](const at::Tensor& table) { return table.view({1, s, 1, head_dim_}); };
  if (!device_cos_.defined() || device_cos_.device() != t.device() || device_cos_.scalar_type() != t.scalar_type()) {
    std::tie(device_cos_, device_sin_) =
        rotary_tables(cos_.size(0), head_dim_, rope_theta_, t.device(), t.scalar_type(), {cos_, sin_});
  }
  if (nn::positions_in_order(positions)) return {rows(device_cos_.narrow(0, 0, s)), rows(device_sin_.narrow(0, 0, s))};
  const at::Tensor index = positions.to(t.device());  // a context-parallel shard's positions
  return {rows(device_cos_.index_select(0, index)), rows(device_sin_.index_select(0, index))};
}

at::Tensor Attention::rotate(const at::Tensor& t, const Rotation& rotation) {
  return rotation.composed ? kernels::rope_composed(t, rotation.cos, rotation.sin)
                           : kernels::rope(t, rotation.cos, rotation.sin);
}

Attention::Rotation Attention::rotation(const at::Tensor& t, const at::Tensor& positions) const {
  if (!t.device().is_cpu() && !t.is_meta()) {  // a device's: the composition on its own tables
    const auto [cos, sin] = rotary_rows(t, positions);
    return {cos, sin, true};
  }
  const bool in_order = nn::positions_in_order(positions);
  const int64_t s = t.size(1);
  at::Tensor cos, sin;
  if (t.device().is_cpu()) {
    // On the host, the fused kernel, given the fp32 rows of the tokens' positions (a slice of the
    // shared tables where the positions are 0..s-1).
    const auto rows = [&](const at::Tensor& table) {
      return in_order ? table.narrow(0, 0, s) : table.index_select(0, positions);
    };
    cos = rows(cos_);
    sin = rows(sin_);
  } else {
    // A dry run takes the host's path with the rows' memory: none where the host's are a slice of
    // the shared tables, their own where it gathers them (made here: a table shared between
    // concurrent dry runs would be counted by one of them).
    const auto rows = [&] {
      const auto options = t.options().dtype(at::kFloat);
      return in_order ? at::empty({}, options).expand({s, head_dim_}) : at::empty({s, head_dim_}, options);
    };
    cos = rows();
    sin = rows();
  }
  return {cos, sin, false};
}

Mlp::Mlp(const LlamaConfig& c)
    : nn::Module("Mlp"),
      gate(add_module("gate", std::make_shared<nn::Linear>(c.dim, c.ffn_hidden, false))),
      up(add_module("up", std::make_shared<nn::Linear>(c.dim, c.ffn_hidden, false))),
      down(add_module("down", std::make_shared<nn::Linear>(c.ffn_hidden, c.dim, false))) {}

at::Tensor Mlp::forward(const at::Tensor& x) { return (*down)(kernels::swiglu((*gate)(x), (*up)(x))); }

Block::Block(const LlamaConfig& c, std::shared_ptr<nn::Module> ffn)
    : nn::Module("Block"),
      attn_norm(add_module("attn_norm", std::make_shared<nn::RMSNorm>(c.dim, c.norm_eps))),
      attn(add_module("attn", std::make_shared<Attention>(c))),
      mlp_norm(add_module("mlp_norm", std::make_shared<nn::RMSNorm>(c.dim, c.norm_eps))),
      mlp(add_module("mlp", ffn ? std::move(ffn) : std::make_shared<Mlp>(c))) {
  if (c.residual_dropout > 0.0) {
    attn_out_dropout = add_module("attn_out_dropout", std::make_shared<nn::Dropout>(c.residual_dropout));
    mlp_out_dropout = add_module("mlp_out_dropout", std::make_shared<nn::Dropout>(c.residual_dropout));
  }
}

at::Tensor Block::forward(const at::Tensor& x) {
  const auto dropped = [](const std::shared_ptr<nn::Dropout>& dropout, const at::Tensor& branch) {
    return dropout ? (*dropout)(branch) : branch;
  };
  const at::Tensor h = x + dropped(attn_out_dropout, (*attn)((*attn_norm)(x)));
  return h + dropped(mlp_out_dropout, (*mlp)((*mlp_norm)(h)));
}

Llama::Llama(const LlamaConfig& c, const FfnFactory& ffn)
    : nn::Module("Llama"),
      embed(add_module("embed", std::make_shared<nn::Embedding>(c.vocab, c.dim))),
      layers(add_module("layers", std::make_shared<nn::Sequential>())),
      norm(add_module("norm", std::make_shared<nn::RMSNorm>(c.dim, c.norm_eps))),
      config_(c) {
  c.validate();
  for (int64_t i = 0; i < c.layers; ++i) layers->push_back(std::make_shared<Block>(c, ffn ? ffn(i) : nullptr));
  if (!c.tie_embeddings) output = add_module("output", std::make_shared<nn::Linear>(c.dim, c.vocab, false));
  embed->set_param_init("weight", nn::Init::normal(0.0, 0.5));
}

at::Tensor Llama::forward(const at::Tensor& tokens) {
  const at::Tensor h = (*norm)((*layers)((*embed)(tokens)));
  return output ? (*output)(h) : at::linear(h, embed->param("weight"));
}

}  // namespace hp::models
