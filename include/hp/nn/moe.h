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
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hp/nn/layers.h"
#include "hp/nn/module.h"

namespace hp::nn {

struct RouterOptions {
  int64_t experts = 8;
  int64_t top_k = 2;
  std::string score_func = "softmax";  // softmax | sigmoid, over the experts, in the routing dtype
  bool norm_topk_prob = false;         // the k gate values are renormalized to sum to 1
  double route_scale = 1.0;            // gate values are multiplied by this
  // Group-limited routing (DeepSeek-V3): the experts form `expert_groups` equal groups; a token
  // may only choose experts of its best `limited_groups` groups, a group scoring the sum of its
  // two highest scores. 1 / 1 = no limit.
  int64_t expert_groups = 1;
  int64_t limited_groups = 1;
  // A per-expert bias added to the scores only to choose the experts (auxiliary-loss-free load
  // balancing, moved by hp::nn::balance_experts); the gate values come from the unbiased scores. A
  // buffer, "expert_bias" (fp32 zeros at first), so checkpoints keep it and no optimizer steps it.
  bool expert_bias = false;
};

// One micro-batch's routing decision.
struct Routing {
  at::Tensor experts;         // [tokens, top_k] int64: the chosen experts, best first
  at::Tensor gates;           // [tokens, top_k]: their gate values (differentiable), routing dtype
  at::Tensor counts;          // [experts] int64, on the tokens' device (the host for meta tokens): the
                              // (token, choice) rows of each expert
  at::Tensor logits, scores;  // [tokens, experts], routing dtype, differentiable: the gate's output, its scores
};

// Token-choice top-k routing: gate = Linear(dim, experts, no bias), computed in the routing dtype:
// fp32, or fp64 for fp64 input (at::promote_types(input, fp32)); so bf16 models route in fp32.
class TokenChoiceTopKRouter : public Module {
 public:
  TokenChoiceTopKRouter(int64_t dim, RouterOptions options);
  // x: [tokens, dim]. With autograd recording (a training forward), adds the counts to
  // tokens_per_expert; evaluation under no_grad counts nothing.
  Routing route(const at::Tensor& x);
  const RouterOptions& options() const { return options_; }

  // Where the routing cannot be computed, tokens on the meta device (a dry run, which has shapes
  // but no scores): how many of the `tokens` tokens' (token, choice) rows each expert gets, a
  // count per expert adding up to tokens * top_k, none above `tokens`. route() then returns these
  // counts on the host, choices of the right shape on meta, and counts nothing for balancing.
  // (hp::train::RoutingModel makes them for a dry run.)
  using ModelledCounts = std::function<std::vector<int64_t>(int64_t tokens)>;
  void set_modelled_counts(ModelledCounts counts) { modelled_counts_ = std::move(counts); }

  std::shared_ptr<Linear> gate;
  at::Tensor expert_bias;        // [experts] fp32, a buffer; undefined without options().expert_bias
  at::Tensor tokens_per_expert;  // [experts] fp64: rows routed since hp::nn::balance_experts last ran

 private:
  // The modelled counts for `tokens` tokens, checked, as a host tensor.
  at::Tensor modelled_counts(int64_t tokens) const;

  RouterOptions options_;
  ModelledCounts modelled_counts_;
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
  // them, or this rank's share under expert parallelism), in expert order. The MoE layer calls the
  // module, (*experts)(rows, counts as an int64 tensor), so that hooks (fully_shard's gather) run.
  at::Tensor run(const at::Tensor& rows, const std::vector<int64_t>& counts);
  int64_t experts, dim, hidden;

 protected:
  at::Tensor forward_inputs(const Inputs& inputs) override;  // (rows, counts)
};

// An expert given more rows than its capacity under CapacityPolicy::kError (expert < 0: none).
struct CapacityOverflow {
  int64_t expert = -1, rows = 0, capacity = 0;
  // "expert 3 got 40 rows, over its capacity of 12 (raise capacity_factor, ...)"
  std::string str() const;
};

// Runs the experts on rows grouped by expert. The default runs them here, on all experts; expert
// parallelism sends each expert's rows to the rank that holds it and brings the outputs back.
class TokenDispatcher {
 public:
  using Experts = std::function<at::Tensor(const at::Tensor& rows, const std::vector<int64_t>& counts)>;
  virtual ~TokenDispatcher() = default;
  // rows [N, dim]: counts[e] rows for each of the layer's experts, in expert order (`counts`: [experts]
  // int64 on the rows' device). Returns the experts' outputs for the same rows, in the same order.
  // A dispatcher reads the counts on the host once (hp::to_host), together with whatever else it
  // must read: the one host sync of a dropless layer's forward. A defined `overflow` is an
  // hp::Error, raised before the experts run; a dispatcher over several ranks raises it on all of
  // them, naming the rank it came from, so that none is left waiting in a collective.
  // `while_dispatching` (may be empty) runs on this thread while the rows travel to the experts'
  // ranks (the MoE layer's shared experts); a dispatcher that sends nothing runs it first.
  virtual at::Tensor run(const at::Tensor& rows, const at::Tensor& counts, const Experts& experts,
                         const CapacityOverflow& overflow, const std::function<void()>& while_dispatching) = 0;
};

// A dense SwiGLU MLP: w2(silu(w1 x) * w3 x), the shared experts of a MoE layer.
class SwiGLU : public Module {
 public:
  SwiGLU(int64_t dim, int64_t hidden);
  std::shared_ptr<Linear> w1, w2, w3;

 protected:
  at::Tensor forward(const at::Tensor& x) override;
};

// What happens to an expert's rows beyond its capacity.
enum class CapacityPolicy {
  kError,       // an hp::Error naming the rank, the expert, its rows and the capacity
  kDropLowest,  // keep the rows with the highest gate values (ties: token order)
  kDropLast,    // keep the first rows in token order
};
// The policy named "error", "drop_lowest" or "drop_last"; nullopt for any other name.
std::optional<CapacityPolicy> capacity_policy_named(const std::string& name);

// The factor the caller applies to the loss of the forwards run in its scope before backward
// (1 / micro-batches under gradient accumulation). The auxiliary losses' gradients are scaled
// alike, so that a step's gradient does not depend on how its batch is split. Thread-local, 1
// outside any scope; hp::train::TrainStep sets it.
class AuxLossScale {
 public:
  explicit AuxLossScale(double scale);
  ~AuxLossScale();
  AuxLossScale(const AuxLossScale&) = delete;
  AuxLossScale& operator=(const AuxLossScale&) = delete;
  static double current();

 private:
  double previous_;
};

struct MoEOptions {
  RouterOptions router;
  int64_t hidden = 0;                // each expert's hidden size
  int64_t shared_hidden = 0;         // > 0: shared experts, a dense SwiGLU of this hidden size added to the output
  bool overlap_shared = true;        // the shared experts run while the dispatch's all_to_all is in flight
  bool gate_before_experts = false;  // scale rows by their gate value before the experts instead of after
  // > 0: of one forward's tokens (on a rank, its own), each expert takes at most
  // ceil(capacity_factor * tokens * top_k / experts) rows; the rest follow capacity_policy. A
  // dropped (token, choice) adds nothing to the token's output: the token passes through the
  // block's residual. 0: dropless.
  double capacity_factor = 0.0;
  CapacityPolicy capacity_policy = CapacityPolicy::kError;
  // Auxiliary losses, each times its coefficient (0: off), added to the training loss through the
  // gradient: the layer's output is unchanged, and in backward the router receives the gradient of
  // their sum times AuxLossScale::current(). With p the scores normalized over the experts and f_e
  // the share of a group's k * tokens choices that went to expert e, times E:
  double aux_loss_coeff = 0.0;      // sum_e f_e * mean_t p_te over the forward's tokens (Switch)
  double seq_aux_loss_coeff = 0.0;  // the same per sequence, averaged over sequences (DeepSeek-V3)
  double z_loss_coeff = 0.0;        // mean_t logsumexp(logits_t)^2 (ST-MoE)
  bool has_aux_loss() const { return aux_loss_coeff != 0 || seq_aux_loss_coeff != 0 || z_loss_coeff != 0; }
};

// How a layer's sequences are split over ranks that each run the layer on their share of every
// sequence's positions (context parallelism, or tensor parallelism splitting the tokens): the
// auxiliary losses' statistics are sums over all of them. `sum` adds a tensor over the shards; its
// backward passes the gradient through (every shard computes the same losses from the sum, and
// each shard's own tokens receive their part), times whatever makes the losses count once after
// the gradient reduction that follows: 1 where the shards' gradients are summed, the number of
// shards where they are averaged. Default: one shard.
struct TokenSplit {
  int64_t shards = 1;
  std::function<at::Tensor(const at::Tensor&)> sum;
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
  // The ranks this layer's sequences are split over (set by a recipe that splits tokens over cp or tp).
  void set_token_split(TokenSplit split);
  // The routed experts' output for `tokens` [tokens, dim] as `routing` routes them (without the
  // shared experts): forward is routed_output(x, router->route(x)) + shared(x), the shared experts
  // computed as routed_output's `while_dispatching` (see TokenDispatcher::run).
  at::Tensor routed_output(const at::Tensor& tokens, const Routing& routing,
                           const std::function<void()>& while_dispatching = {});
  // The routing of the last forward, without its autograd history.
  const Routing& last_routing() const { return routing_; }
  // The (token, choice) rows the last routed_output dropped over capacity.
  int64_t last_dropped() const { return dropped_; }
  // Rows dropped by forwards under autograd since hp::nn::balance_experts last ran.
  int64_t dropped_since_balance = 0;
  // The auxiliary losses (coefficients applied) of those forwards, summed (fp64, kept on the
  // device: no host read per forward), and how many there were.
  at::Tensor aux_loss_since_balance;
  int64_t forwards_since_balance = 0;
  // The auxiliary losses of `routing` (coefficients applied) for `sequences` equal sequences of its
  // tokens (with a token split, this shard's positions of each; the statistics are summed over the
  // shards); an undefined tensor when every coefficient is 0.
  at::Tensor aux_loss(const Routing& routing, int64_t sequences) const;
  const MoEOptions& options() const { return options_; }

 protected:
  at::Tensor forward(const at::Tensor& x) override;

 private:
  MoEOptions options_;
  std::shared_ptr<TokenDispatcher> dispatcher_;
  TokenSplit token_split_;
  Routing routing_;
  int64_t dropped_ = 0;
};

// One router's load over a step (what balance_experts saw).
struct ExpertLoad {
  std::string fqn;             // the router's
  std::vector<double> counts;  // rows per expert, summed over the step's forwards and the data ranks
  double max_over_mean = 0.0;  // the busiest expert's count over the mean count (1 = balanced)
  double bias_norm = 0.0;      // L2 norm of the expert bias after the update (0 without one)
  double dropped = 0.0;        // rows its MoE layer dropped over capacity, summed like the counts
  double aux_loss = 0.0;       // its MoE layer's auxiliary losses, the mean over forwards and ranks
};

// Every router of `model` with its FQN, in model order.
std::vector<std::pair<std::string, TokenChoiceTopKRouter*>> routers_of(Module& model);

// Auxiliary-loss-free load balancing (DeepSeek-V3), run once per step before the optimizer steps.
// For every router of `model`, in model order: its tokens_per_expert (and its MoE layer's dropped
// rows and auxiliary losses) are summed over the ranks that saw other tokens by
// `sum_over_data_ranks` (one call on all routers' numbers concatenated, e.g. an all_reduce over the
// data-parallel group; nothing to do on one rank), then, with `rate` > 0 and an expert bias,
// bias += rate * sign(mean - count), re-centred to zero mean, and the counts restart from zero.
// Counts are integers, so every rank computes the same bias bitwise.
std::vector<ExpertLoad> balance_experts(Module& model, double rate,
                                        const std::function<void(at::Tensor& counts)>& sum_over_data_ranks);

// Forgets what the routers and MoE layers of `model` counted since balance_experts last ran (token
// counts, dropped rows, auxiliary losses), as balance_experts does after using them: for a step
// that runs again from its start (hp::train's rerun on an anomaly), whose first run must not count.
void forget_expert_counts(Module& model);

}  // namespace hp::nn
