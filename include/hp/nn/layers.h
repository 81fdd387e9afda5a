// The layers LLMs are built from, as hp::nn modules. Parameter names and layouts follow
// torch.nn (Linear.weight is [out, in]), so PyTorch-style plans and checkpoints map one to one.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "hp/nn/module.h"
#include "hp/nn/token_coordinates.h"

namespace hp::nn {

// y = x W^T + b. Default init as torch.nn.Linear: uniform(-1/sqrt(in), 1/sqrt(in)).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true);
  int64_t in_features, out_features;
  bool has_bias;

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

// Rows of `weight` [num_embeddings, dim] picked by integer indices. Init: normal(0, 1).
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim);
  int64_t num_embeddings, embedding_dim;

 protected:
  at::Tensor forward(const at::Tensor& indices) override;
};

// x / sqrt(mean(x^2, last dim) + eps) * weight, computed in fp32 (fp64 for fp64 inputs). Init: ones.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6);
  int64_t dim;
  double eps;

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

// torch.nn.LayerNorm over the last dim, with weight (ones) and bias (zeros).
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5);
  int64_t dim;
  double eps;

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

// Zeroes elements with probability p in training mode (and scales the rest by 1/(1-p)), from a
// counter-based generator (Philox) keyed by this module's seed, which init_parameters derives from
// the model seed and the module's FQN (0 until then; never a process-global generator, which ranks
// running as threads would share).
//
// Where token coordinates are in effect (hp/nn/token_coordinates.h; hp-train sets them), the input
// is [rows, tokens, ...] and element (row, position, i...) of the global batch keeps or drops by
// its global index under the step's stream: a data-parallel rank's rows, a micro-batch, a context-
// parallel shard and a DTensor's piece (sequence- or feature-sharded, or replicated) each get their
// part of the mask one device draws for the whole batch. Without coordinates the mask covers the
// tensor as given (a DTensor's from the mesh's RNG, hp/dtensor/random.h). Recomputation replays it.
class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5);
  double p;
  void seed(uint64_t seed);  // init_parameters seeds each Dropout apart

 protected:
  at::Tensor forward(const at::Tensor& x) override;

 private:
  uint64_t seed_ = 0;
  DrawCounter draws_;
};

// Children named "0", "1", ...; calling it runs them in order (torch.nn.Sequential). Holding layers
// in a ModuleList and looping in forward works the same; both give FQNs like "layers.3.attn".
class Sequential : public Module {
 public:
  Sequential();
  void push_back(std::shared_ptr<Module> module);
  size_t size() const { return items_.size(); }
  Module& operator[](size_t i) const { return *items_.at(i); }
  const std::vector<std::shared_ptr<Module>>& items() const { return items_; }

 protected:
  at::Tensor forward(const at::Tensor& x) override;

 private:
  std::vector<std::shared_ptr<Module>> items_;
};

using ModuleList = Sequential;

}  // namespace hp::nn
