// Mixture-of-Experts building blocks (DeepSeek-V3 / Qwen3-MoE style), written without parallel code:
// a token-choice top-k router, SwiGLU experts stored as stacked weights, and the MoE layer that
// routes each token to k experts, groups the rows by expert, runs the experts through a
// TokenDispatcher and combines their outputs with the gate values.
//
//   hp::nn::MoEOptions o;
//   o.router = {.experts = 8, .top_k = 2, .norm_topk_prob = true};
//   o.hidden = 512;
//   auto moe = std::make_shared<hp::nn::MoE>(/*dim=*/256, o);   // [..., 256] -> [..., 256]
//
// Expert parallelism replaces the dispatcher from outside (hp::ExpertParallel in
// hp/parallel/expert_parallel.h); the layer's code does not change.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/nn/layers.h"
#include "hp/nn/module.h"

namespace hp::nn {

struct RouterOptions {
  int64_t experts = 8;
  int64_t top_k = 2;
  std::string score_func = "softmax";  // softmax | sigmoid, over the experts, in fp32
  bool norm_topk_prob = false;         // the k gate values are renormalized to sum to 1
  double route_scale = 1.0;            // gate values are multiplied by this
  // Group-limited routing (DeepSeek-V3): the experts form `expert_groups` equal groups; a token
  // may only choose experts of its best `limited_groups` groups, a group scoring the sum of its
  // two highest scores. 1 / 1 = no limit.
  int64_t expert_groups = 1;
  int64_t limited_groups = 1;
  // A per-expert bias added to the scores only to choose the experts (auxiliary-loss-free load
  // balancing); the gate values come from the unbiased scores. A parameter without gradient,
  // "expert_bias", initialized to zeros.
  bool expert_bias = false;
};

// One micro-batch's routing decision.
struct Routing {
  at::Tensor experts;           // [tokens, top_k] int64: the chosen experts, best first
  at::Tensor gates;             // [tokens, top_k] fp32: their gate values (differentiable)
  std::vector<int64_t> counts;  // [experts]: how many (token, choice) rows each expert gets
};

// Token-choice top-k routing: gate = Linear(dim, experts, no bias), computed in fp32.
class TokenChoiceTopKRouter : public Module {
 public:
  TokenChoiceTopKRouter(int64_t dim, RouterOptions options);
  // x: [tokens, dim].
  Routing route(const at::Tensor& x);
  const RouterOptions& options() const { return options_; }
  std::shared_ptr<Linear> gate;

 private:
  RouterOptions options_;
};

// For each group g, the next counts[g] rows of `rows` [N, in] times weights[g]^T ([groups, out, in]):
// [N, out]. Groups with no rows are skipped. The one seam a grouped GEMM kernel replaces.
at::Tensor grouped_mm(const at::Tensor& rows, const at::Tensor& weights, const std::vector<int64_t>& counts);

// `experts` SwiGLU experts as stacked weights w1 [E, hidden, dim], w2 [E, dim, hidden] and
// w3 [E, hidden, dim]: expert e maps a row x to w2[e] (silu(w1[e] x) * w3[e] x). Init as Linear.
class GroupedExperts : public Module {
 public:
  GroupedExperts(int64_t experts, int64_t dim, int64_t hidden);
  // rows [N, dim], grouped by expert: counts[e] rows for each expert this module holds (all of
  // them, or this rank's share under expert parallelism), in expert order.
  at::Tensor run(const at::Tensor& rows, const std::vector<int64_t>& counts);
  int64_t experts, dim, hidden;
};

// Runs the experts on rows grouped by expert. The default runs them here, on all experts; expert
// parallelism sends each expert's rows to the rank that holds it and brings the outputs back.
class TokenDispatcher {
 public:
  using Experts = std::function<at::Tensor(const at::Tensor& rows, const std::vector<int64_t>& counts)>;
  virtual ~TokenDispatcher() = default;
  // rows [N, dim]: counts[e] rows for each of the layer's experts, in expert order. Returns the
  // experts' outputs for the same rows, in the same order.
  virtual at::Tensor run(const at::Tensor& rows, const std::vector<int64_t>& counts, const Experts& experts) = 0;
};

// A dense SwiGLU MLP: w2(silu(w1 x) * w3 x), the shared experts of a MoE layer.
class SwiGLU : public Module {
 public:
  SwiGLU(int64_t dim, int64_t hidden);
  std::shared_ptr<Linear> w1, w2, w3;

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

struct MoEOptions {
  RouterOptions router;
  int64_t hidden = 0;                // each expert's hidden size
  int64_t shared_hidden = 0;         // > 0: shared experts, a dense SwiGLU of this hidden size added to the output
  bool gate_before_experts = false;  // scale rows by their gate value before the experts instead of after
};

// [..., dim] -> [..., dim]. Rows go to the experts grouped by expert with a stable sort of the
// (token, choice) pairs, so each expert sees its rows in token order; the k outputs of a token are
// summed in choice order.
class MoE : public Module {
 public:
  MoE(int64_t dim, MoEOptions options);
  std::shared_ptr<TokenChoiceTopKRouter> router;
  std::shared_ptr<GroupedExperts> experts;
  std::shared_ptr<SwiGLU> shared;  // null without shared experts
  // Who runs the experts (set by hp::ExpertParallel); the default runs them here.
  void set_dispatcher(std::shared_ptr<TokenDispatcher> dispatcher);
  // The routed experts' output for `tokens` [tokens, dim] as `routing` routes them (without the
  // shared experts): forward is routed_output(x, router->route(x)) + shared(x).
  at::Tensor routed_output(const at::Tensor& tokens, const Routing& routing);
  // The routing of the last forward.
  const Routing& last_routing() const { return routing_; }
  const MoEOptions& options() const { return options_; }

 protected:
  at::Tensor forward(const at::Tensor& x) override;

 private:
  MoEOptions options_;
  std::shared_ptr<TokenDispatcher> dispatcher_;
  Routing routing_;
};

}  // namespace hp::nn
