#include "hp/nn/moe.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"

namespace hp::nn {
namespace {

// Runs every expert here.
class LocalDispatcher : public TokenDispatcher {
 public:
  at::Tensor run(const at::Tensor& rows, const std::vector<int64_t>& counts, const Experts& experts) override {
    return experts(rows, counts);
  }
};

// The piece of a parameter this rank computes with: a DTensor's local piece (differentiably), else
// the tensor. Under expert parallelism the experts' weights are Shard(0): this rank's experts.
at::Tensor local_weight(const at::Tensor& p) { return is_dtensor(p) ? DTensor(p).to_local() : p; }

void check_router_options(const RouterOptions& o) {
  HP_CHECK(o.experts > 0 && o.top_k > 0 && o.top_k <= o.experts, "MoE router: need 1 <= top_k (", o.top_k,
           ") <= experts (", o.experts, ")");
  HP_CHECK(o.score_func == "softmax" || o.score_func == "sigmoid", "MoE router: score_func '", o.score_func,
           "' is unknown (softmax, sigmoid)");
  HP_CHECK(o.route_scale > 0, "MoE router: route_scale must be positive, got ", o.route_scale);
  HP_CHECK(o.expert_groups > 0 && o.experts % o.expert_groups == 0, "MoE router: experts (", o.experts,
           ") must split into expert_groups (", o.expert_groups, ") equal groups");
  HP_CHECK(o.limited_groups > 0 && o.limited_groups <= o.expert_groups, "MoE router: limited_groups (",
           o.limited_groups, ") must be in 1..expert_groups (", o.expert_groups, ")");
  if (o.limited_groups < o.expert_groups) {
    const int64_t per_group = o.experts / o.expert_groups;
    HP_CHECK(per_group >= 2, "MoE router: group-limited routing scores a group by its top 2 experts; groups of ",
             per_group, " expert are too small");
    HP_CHECK(o.top_k <= o.limited_groups * per_group, "MoE router: top_k (", o.top_k, ") exceeds the ",
             o.limited_groups * per_group, " experts of the limited_groups groups");
  }
}

}  // namespace

// ---- TokenChoiceTopKRouter ----------------------------------------------------------------------

TokenChoiceTopKRouter::TokenChoiceTopKRouter(int64_t dim, RouterOptions options)
    : Module("TokenChoiceTopKRouter"),
      gate(add_module("gate", std::make_shared<Linear>(dim, options.experts, false))),
      options_(std::move(options)) {
  check_router_options(options_);
  if (options_.expert_bias) add_param("expert_bias", {options_.experts}, Init::constant(0.0), false);
}

Routing TokenChoiceTopKRouter::route(const at::Tensor& x) {
  const RouterOptions& o = options_;
  HP_CHECK(x.dim() == 2, "MoE router: expects [tokens, dim], got ", x.sizes());
  const at::Tensor logits = at::linear(x.to(at::kFloat), gate->param("weight").to(at::kFloat));
  const at::Tensor scores = o.score_func == "softmax" ? at::softmax(logits, -1) : at::sigmoid(logits);
  // Which experts: the scores (plus the balancing bias), within the best groups.
  at::Tensor choice = scores.detach();
  if (o.expert_bias) choice = choice + param("expert_bias").detach().to(at::kFloat);
  if (o.limited_groups < o.expert_groups) {
    const int64_t tokens = choice.size(0);
    const at::Tensor grouped = choice.view({tokens, o.expert_groups, -1});
    const at::Tensor group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);
    const at::Tensor best = std::get<1>(group_scores.topk(o.limited_groups, -1));
    const at::Tensor excluded = at::ones({tokens, o.expert_groups}, choice.options().dtype(at::kBool))
                                    .scatter_(1, best, at::zeros_like(best, at::kBool));
    choice =
        grouped.masked_fill(excluded.unsqueeze(-1), -std::numeric_limits<float>::infinity()).view({tokens, o.experts});
  }
  Routing routing;
  routing.experts = std::get<1>(choice.topk(o.top_k, -1, /*largest=*/true, /*sorted=*/true));
  // The gate values: from the unbiased scores, so the bias steers choices but not outputs.
  at::Tensor gates = scores.gather(1, routing.experts);
  if (o.norm_topk_prob) gates = gates / gates.sum(-1, /*keepdim=*/true);
  if (o.route_scale != 1.0) gates = gates * o.route_scale;
  routing.gates = gates;
  const at::Tensor counts = at::bincount(routing.experts.reshape({-1}), {}, o.experts);
  routing.counts.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + o.experts);
  return routing;
}

// ---- experts ------------------------------------------------------------------------------------

at::Tensor grouped_mm(const at::Tensor& rows, const at::Tensor& weights, const std::vector<int64_t>& counts) {
  HP_CHECK(rows.dim() == 2 && weights.dim() == 3 && weights.size(2) == rows.size(1), "grouped_mm: rows ", rows.sizes(),
           " do not fit weights ", weights.sizes());
  HP_CHECK(static_cast<int64_t>(counts.size()) == weights.size(0), "grouped_mm: ", counts.size(), " group counts for ",
           weights.size(0), " groups");
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  HP_CHECK(total == rows.size(0), "grouped_mm: the counts add up to ", total, " rows, got ", rows.size(0));
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (size_t g = 0; g < counts.size(); ++g) {
    if (counts[g] == 0) continue;
    out.push_back(at::mm(rows.narrow(0, offset, counts[g]), weights[g].t()));
    offset += counts[g];
  }
  // No rows at all: an empty product that still reaches the weights, so they get (zero) gradients.
  if (out.empty()) return at::mm(rows, weights[0].t());
  return out.size() == 1 ? out[0] : at::cat(out, 0);
}

GroupedExperts::GroupedExperts(int64_t experts_, int64_t dim_, int64_t hidden_)
    : Module("GroupedExperts"), experts(experts_), dim(dim_), hidden(hidden_) {
  HP_CHECK(experts > 0 && dim > 0 && hidden > 0, "GroupedExperts: experts, dim and hidden must be positive");
  const double in_bound = 1.0 / std::sqrt(static_cast<double>(dim));
  const double hidden_bound = 1.0 / std::sqrt(static_cast<double>(hidden));
  add_param("w1", {experts, hidden, dim}, Init::uniform(-in_bound, in_bound));
  add_param("w2", {experts, dim, hidden}, Init::uniform(-hidden_bound, hidden_bound));
  add_param("w3", {experts, hidden, dim}, Init::uniform(-in_bound, in_bound));
}

at::Tensor GroupedExperts::run(const at::Tensor& rows, const std::vector<int64_t>& counts) {
  const at::Tensor w1 = local_weight(param("w1")), w2 = local_weight(param("w2")), w3 = local_weight(param("w3"));
  const at::Tensor h = at::silu(grouped_mm(rows, w1, counts)) * grouped_mm(rows, w3, counts);
  return grouped_mm(h, w2, counts);
}

// ---- SwiGLU, MoE --------------------------------------------------------------------------------

SwiGLU::SwiGLU(int64_t dim, int64_t hidden)
    : Module("SwiGLU"),
      w1(add_module("w1", std::make_shared<Linear>(dim, hidden, false))),
      w2(add_module("w2", std::make_shared<Linear>(hidden, dim, false))),
      w3(add_module("w3", std::make_shared<Linear>(dim, hidden, false))) {}

at::Tensor SwiGLU::forward(const at::Tensor& x) { return (*w2)(at::silu((*w1)(x)) * (*w3)(x)); }

MoE::MoE(int64_t dim, MoEOptions options)
    : Module("MoE"),
      router(add_module("router", std::make_shared<TokenChoiceTopKRouter>(dim, options.router))),
      experts(add_module("experts", std::make_shared<GroupedExperts>(options.router.experts, dim, options.hidden))),
      options_(std::move(options)),
      dispatcher_(std::make_shared<LocalDispatcher>()) {
  if (options_.shared_hidden > 0) shared = add_module("shared", std::make_shared<SwiGLU>(dim, options_.shared_hidden));
}

void MoE::set_dispatcher(std::shared_ptr<TokenDispatcher> dispatcher) {
  HP_CHECK(dispatcher != nullptr, "MoE::set_dispatcher: no dispatcher");
  dispatcher_ = std::move(dispatcher);
}

at::Tensor MoE::forward(const at::Tensor& x) {
  const at::Tensor tokens = x.reshape({-1, x.size(-1)});
  routing_ = router->route(tokens);
  at::Tensor out = routed_output(tokens, routing_);
  if (shared) out = out + (*shared)(tokens);
  return out.view(x.sizes());
}

at::Tensor MoE::routed_output(const at::Tensor& tokens, const Routing& routing) {
  HP_CHECK(tokens.dim() == 2 && routing.experts.dim() == 2 && routing.experts.size(0) == tokens.size(0),
           "MoE: a routing of ", routing.experts.sizes(), " for tokens of shape ", tokens.sizes());
  const int64_t dim = tokens.size(1), k = routing.experts.size(1);
  // Rows grouped by expert: a stable sort of the (token, choice) slots keeps token order within
  // an expert, so an expert's rows do not depend on how the tokens were split over ranks.
  const at::Tensor order = std::get<1>(at::sort(routing.experts.reshape({-1}), /*stable=*/true, 0, false));
  at::Tensor rows = tokens.index_select(0, at::div(order, k, "floor"));
  if (options_.gate_before_experts)
    rows = (rows.to(at::kFloat) * routing.gates.reshape({-1}).index_select(0, order).unsqueeze(1))
               .to(tokens.scalar_type());
  const at::Tensor out_rows = dispatcher_->run(
      rows, routing.counts, [this](const at::Tensor& r, const std::vector<int64_t>& c) { return experts->run(r, c); });
  // Back to (token, choice) order; a token's k outputs are summed in choice order.
  const at::Tensor row_of_slot = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()));
  const at::Tensor by_slot = out_rows.index_select(0, row_of_slot).view({-1, k, dim});
  at::Tensor out;
  for (int64_t j = 0; j < k; ++j) {
    at::Tensor term = by_slot.select(1, j);
    if (!options_.gate_before_experts)
      term = (term.to(at::kFloat) * routing.gates.select(1, j).unsqueeze(1)).to(tokens.scalar_type());
    out = j == 0 ? term : out + term;
  }
  return out;
}

}  // namespace hp::nn
