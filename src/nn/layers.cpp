#include "hp/nn/layers.h"

#include <ATen/ATen.h>

#include <cmath>

#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"
#include "hp/kernels/rms_norm.h"

namespace hp::nn {

Linear::Linear(int64_t in, int64_t out, bool bias)
    : Module("Linear"), in_features(in), out_features(out), has_bias(bias) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  add_param("weight", {out, in}, Init::uniform(-bound, bound));
  if (bias) add_param("bias", {out}, Init::uniform(-bound, bound));
}

at::Tensor Linear::forward(const at::Tensor& x) {
  return at::linear(x, param("weight"), has_bias ? param("bias") : at::Tensor());
}

Embedding::Embedding(int64_t num, int64_t dim) : Module("Embedding"), num_embeddings(num), embedding_dim(dim) {
  add_param("weight", {num, dim}, Init::normal(0.0, 1.0));
}

at::Tensor Embedding::forward(const at::Tensor& indices) {
  HP_CHECK(!indices.is_floating_point(), "Embedding: indices must be integers, got ", indices.scalar_type());
  return at::embedding(param("weight"), indices);
}

RMSNorm::RMSNorm(int64_t d, double e) : Module("RMSNorm"), dim(d), eps(e) {
  add_param("weight", {d}, Init::constant(1.0));
}

at::Tensor RMSNorm::forward(const at::Tensor& x) { return kernels::rms_norm(x, param("weight"), eps); }

LayerNorm::LayerNorm(int64_t d, double e) : Module("LayerNorm"), dim(d), eps(e) {
  add_param("weight", {d}, Init::constant(1.0));
  add_param("bias", {d}, Init::constant(0.0));
}

at::Tensor LayerNorm::forward(const at::Tensor& x) {
  return at::layer_norm(x, {dim}, param("weight"), param("bias"), eps);
}

Sequential::Sequential() : Module("Sequential") {}

void Sequential::push_back(std::shared_ptr<Module> module) {
  HP_CHECK(module != nullptr, "Sequential: cannot add an empty module");
  items_.push_back(add_module(std::to_string(items_.size()), std::move(module)));
}

at::Tensor Sequential::forward(const at::Tensor& x) {
  at::Tensor h = x;
  for (const auto& m : items_) h = (*m)(h);
  return h;
}

}  // namespace hp::nn
