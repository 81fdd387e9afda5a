#include "hp/nn/moe.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>

#include "hp/core/error.h"
#include "hp/core/host_sync.h"
#include "hp/core/lambda_backward.h"
#include "hp/core/recompute.h"
#include "hp/dtensor/dtensor.h"
#include "hp/kernels/swiglu.h"

namespace hp::nn {
namespace {

// Runs every expert here.
class LocalDispatcher : public TokenDispatcher {
 public:
  at::Tensor run(const at::Tensor& rows, const at::Tensor& counts, const Experts& experts,
                 const CapacityOverflow& overflow, const std::function<void()>& while_dispatching) override {
    HP_CHECK(overflow.expert < 0, "MoE: ", overflow.str());
    if (while_dispatching) while_dispatching();
    return experts(rows, replayed<std::vector<int64_t>>([&] { return to_host_int64s(counts); }));
  }
};

// Whether this forward counts for the balancing statistics: a training forward, once (a checkpointed
// region's recomputation ran the same forward before).
bool training_forward() { return at::GradMode::is_enabled() && !recomputing(); }

// The top-k experts of each token by `choice` [tokens, experts] (the scores plus any balancing
// bias), restricted to the best `limited_groups` groups under group-limited routing.
at::Tensor choose_experts(at::Tensor choice, const RouterOptions& o) {
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
  return std::get<1>(choice.topk(o.top_k, -1, /*largest=*/true, /*sorted=*/true));
}

// The piece of a parameter this rank computes with: a DTensor's local piece (differentiably), else
// the tensor. Under expert parallelism the experts' weights are Shard(0): this rank's experts.
at::Tensor local_weight(const at::Tensor& p) { return is_dtensor(p) ? DTensor(p).to_local() : p; }

// Marks the (token, choice) slots beyond each expert's capacity as dropped by giving them the expert
// id `experts`, which sorts after every real one; counts become the kept rows.
at::Tensor drop_over_capacity(at::Tensor slot_expert, const at::Tensor& slot_gate, std::vector<int64_t>& counts,
                              int64_t capacity, CapacityPolicy policy) {
  const int64_t experts = static_cast<int64_t>(counts.size());
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e] <= capacity) continue;
    if (slot_expert.is_meta()) {  // modelled counts (a dry run): which slots go has no shape to change
      counts[e] = capacity;
      continue;
    }
    const at::Tensor slots = at::nonzero(slot_expert == e).view({-1});  // in token order
    at::Tensor dropped;
    if (policy == CapacityPolicy::kDropLast) {
      dropped = slots.narrow(0, capacity, counts[e] - capacity);
    } else {  // the lowest gates; a stable sort keeps ties in token order
      const at::Tensor by_gate = std::get<1>(at::sort(slot_gate.index_select(0, slots), /*stable=*/true, 0, true));
      dropped = slots.index_select(0, by_gate.narrow(0, capacity, counts[e] - capacity));
    }
    slot_expert.index_fill_(0, dropped, experts);
    counts[e] = capacity;
  }
  return slot_expert;
}

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
  if (options_.expert_bias) expert_bias = register_buffer("expert_bias", at::zeros({options_.experts}, at::kFloat));
  tokens_per_expert = at::zeros({options_.experts}, at::kDouble);
}

Routing TokenChoiceTopKRouter::route(const at::Tensor& x) {
  const RouterOptions& o = options_;
  HP_CHECK(x.dim() == 2, "MoE router: expects [tokens, dim], got ", x.sizes());
  const at::ScalarType dtype = at::promote_types(x.scalar_type(), at::kFloat);
  const at::Tensor logits = at::linear(x.to(dtype), gate->param("weight").to(dtype));
  const at::Tensor scores = o.score_func == "softmax" ? at::softmax(logits, -1) : at::sigmoid(logits);
  // Which experts: the scores (plus the balancing bias), within the best groups.
  Routing routing;
  // The choice is data-dependent: a recomputation (activation checkpointing) replays the first
  // pass's instead of choosing again, so that both route alike whatever the rounding.
  // (On meta scores, a dry run's, the choice has a shape but no values: the bias changes nothing.)
  routing.experts = replayed<at::Tensor>([&] {
    return choose_experts(o.expert_bias && !x.is_meta() ? scores.detach() + expert_bias : scores.detach(), o);
  });
  // The gate values: from the unbiased scores, so the bias steers choices but not outputs.
  at::Tensor gates = scores.gather(1, routing.experts);
  if (o.norm_topk_prob) gates = gates / gates.sum(-1, /*keepdim=*/true);
  if (o.route_scale != 1.0) gates = gates * o.route_scale;
  routing.gates = gates;
  routing.logits = logits;
  routing.scores = scores;
  if (x.is_meta()) {
    routing.counts = modelled_counts(x.size(0));
    return routing;
  }
  routing.counts = at::bincount(routing.experts.reshape({-1}), {}, o.experts);
  if (training_forward()) tokens_per_expert.add_(routing.counts);
  return routing;
}

at::Tensor TokenChoiceTopKRouter::modelled_counts(int64_t tokens) const {
  const RouterOptions& o = options_;
  HP_CHECK(modelled_counts_ != nullptr,
           "MoE router: tokens on the meta device have no scores to route by; a dry run gives the router a "
           "routing model (set_modelled_counts)");
  const std::vector<int64_t> counts = modelled_counts_(tokens);
  HP_CHECK(static_cast<int64_t>(counts.size()) == o.experts, "MoE router: the routing model gave ", counts.size(),
           " counts for ", o.experts, " experts");
  HP_CHECK(std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c >= 0 && c <= tokens; }),
           "MoE router: the routing model gave an expert a count outside [0, ", tokens,
           "] (one row per token at most)");
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  HP_CHECK(total == tokens * o.top_k, "MoE router: the routing model's counts add up to ", total, ", not ",
           tokens * o.top_k, " (", tokens, " tokens x top_k ", o.top_k, ")");
  return at::tensor(counts, at::kLong);
}

// ---- experts ------------------------------------------------------------------------------------

at::Tensor grouped_mm(const at::Tensor& rows, const at::Tensor& weights, const std::vector<int64_t>& counts) {
  HP_CHECK(rows.dim() == 2 && weights.dim() == 3 && weights.size(2) == rows.size(1), "grouped_mm: rows ", rows.sizes(),
           " do not fit weights ", weights.sizes());
  HP_CHECK(static_cast<int64_t>(counts.size()) == weights.size(0), "grouped_mm: ", counts.size(), " group counts for ",
           weights.size(0), " groups");
  HP_CHECK(std::all_of(counts.begin(), counts.end(), [](int64_t c) { return c >= 0; }),
           "grouped_mm: a negative group count");
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  HP_CHECK(total == rows.size(0), "grouped_mm: the counts add up to ", total, " rows, got ", rows.size(0));
  // One unbind and one split: their backwards are one stack and one cat, where a narrow and a
  // select per group would each allocate a gradient of the whole stacked weight.
  const std::vector<at::Tensor> weight = weights.unbind(0), piece = rows.split_with_sizes(counts);
  std::vector<at::Tensor> out;
  for (size_t g = 0; g < counts.size(); ++g)
    if (counts[g] > 0) out.push_back(at::mm(piece[g], weight[g].t()));
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
  const at::Tensor h = kernels::swiglu(grouped_mm(rows, w1, counts), grouped_mm(rows, w3, counts));
  return grouped_mm(h, w2, counts);
}

at::Tensor GroupedExperts::forward_inputs(const Inputs& inputs) {
  HP_CHECK(inputs.size() == 2 && inputs[1].dim() == 1 && inputs[1].scalar_type() == at::kLong,
           "GroupedExperts: takes (rows, counts as a 1-D int64 tensor)");
  HP_CHECK(inputs[1].device().is_cpu(), "GroupedExperts: the counts must be on the CPU (they size the GEMMs)");
  const at::Tensor counts = inputs[1].contiguous();
  return run(inputs[0], std::vector<int64_t>(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel()));
}

// ---- SwiGLU, MoE --------------------------------------------------------------------------------

SwiGLU::SwiGLU(int64_t dim, int64_t hidden)
    : Module("SwiGLU"),
      w1(add_module("w1", std::make_shared<Linear>(dim, hidden, false))),
      w2(add_module("w2", std::make_shared<Linear>(hidden, dim, false))),
      w3(add_module("w3", std::make_shared<Linear>(dim, hidden, false))) {}

at::Tensor SwiGLU::forward(const at::Tensor& x) { return (*w2)(kernels::swiglu((*w1)(x), (*w3)(x))); }

MoE::MoE(int64_t dim, MoEOptions options)
    : Module("MoE"),
      router(add_module("router", std::make_shared<TokenChoiceTopKRouter>(dim, options.router))),
      experts(add_module("experts", std::make_shared<GroupedExperts>(options.router.experts, dim, options.hidden))),
      options_(std::move(options)),
      dispatcher_(std::make_shared<LocalDispatcher>()) {
  HP_CHECK(options_.capacity_factor >= 0 && std::isfinite(options_.capacity_factor),
           "MoE: capacity_factor must be >= 0 (0: no capacity), got ", options_.capacity_factor);
  if (options_.shared_hidden > 0) shared = add_module("shared", std::make_shared<SwiGLU>(dim, options_.shared_hidden));
  for (double coeff : {options_.aux_loss_coeff, options_.seq_aux_loss_coeff, options_.z_loss_coeff})
    HP_CHECK(coeff >= 0 && std::isfinite(coeff), "MoE: auxiliary loss coefficients must be >= 0, got ", coeff);
  aux_loss_since_balance = at::zeros({}, at::kDouble);
}

void MoE::set_dispatcher(std::shared_ptr<TokenDispatcher> dispatcher) {
  HP_CHECK(dispatcher != nullptr, "MoE::set_dispatcher: no dispatcher");
  dispatcher_ = std::move(dispatcher);
}

at::Tensor MoE::forward(const at::Tensor& x) {
  const at::Tensor tokens = x.reshape({-1, x.size(-1)});
  const Routing routing = router->route(tokens);
  // Kept for last_routing() without its graph, which would hold the router's activations.
  routing_ = {routing.experts, routing.gates.detach(), routing.counts, routing.logits.detach(),
              routing.scores.detach()};
  at::Tensor shared_out;
  const auto run_shared = [&] { shared_out = (*shared)(tokens); };
  at::Tensor out =
      routed_output(tokens, routing, shared && options_.overlap_shared ? run_shared : std::function<void()>{});
  if (shared && !shared_out.defined()) run_shared();
  if (shared) out = out + shared_out;
  // [batch, seq, dim]: batch sequences; otherwise the tokens are one sequence.
  if (const at::Tensor aux = aux_loss(routing, x.dim() == 3 ? x.size(0) : 1); aux.defined()) {
    if (training_forward() && !aux.is_meta()) {  // a dry run's (meta) losses count nothing for balancing
      aux_loss_since_balance.add_(aux.detach());
      ++forwards_since_balance;
    }
    // The output unchanged; backward also sends the scaled unit gradient into the losses.
    const double scale = AuxLossScale::current();
    const at::TensorOptions unit = aux.options();
    out = record_backward("moe_aux_loss", {out, aux}, out.detach(), [scale, unit](const at::Tensor& grad) {
      return std::vector<at::Tensor>{grad, at::full({}, scale, unit)};
    });
  }
  return out.view(x.sizes());
}

at::Tensor MoE::aux_loss(const Routing& routing, int64_t sequences) const {
  const MoEOptions& o = options_;
  if (!o.has_aux_loss()) return {};
  const int64_t tokens = routing.scores.size(0), experts = routing.scores.size(1), k = routing.experts.size(1);
  HP_CHECK(sequences > 0 && tokens % sequences == 0, "MoE: ", tokens, " tokens do not form ", sequences,
           " equal sequences");
  // p: the scores as a distribution over the experts; chosen: the choices, one-hot.
  const at::Tensor p =
      o.router.score_func == "softmax" ? routing.scores : routing.scores / routing.scores.sum(-1, true);
  const at::Tensor chosen = at::zeros({tokens, experts}, p.options()).scatter_(1, routing.experts, 1.0);
  // Every statistic as a sum over this forward's tokens, all in one tensor, summed over the token
  // shards at once; the divisions count every shard's tokens.
  const int64_t length = tokens / sequences, shards = token_split_.shards;
  std::vector<at::Tensor> sums;
  if (o.aux_loss_coeff != 0) sums.push_back(at::stack({chosen.sum(0), p.sum(0)}).view({-1}));
  if (o.seq_aux_loss_coeff != 0)
    sums.push_back(
        at::stack({chosen.view({sequences, length, experts}).sum(1), p.view({sequences, length, experts}).sum(1)})
            .view({-1}));
  if (o.z_loss_coeff != 0) sums.push_back(at::logsumexp(routing.logits, -1).pow(2).sum().view({1}));
  at::Tensor all = at::cat(sums);
  if (shards > 1) all = token_split_.sum(all);
  at::Tensor total = at::zeros({}, p.options());
  int64_t offset = 0;
  const auto next = [&](int64_t n) {
    const at::Tensor piece = all.narrow(0, offset, n);
    offset += n;
    return piece;
  };
  if (o.aux_loss_coeff != 0) {
    const at::Tensor s = next(2 * experts).view({2, experts});
    const double all_tokens = static_cast<double>(tokens * shards);
    const at::Tensor f = s[0] * (static_cast<double>(experts) / (static_cast<double>(k) * all_tokens));
    total = total + o.aux_loss_coeff * (f * (s[1] / all_tokens)).sum();
  }
  if (o.seq_aux_loss_coeff != 0) {
    const at::Tensor s = next(2 * sequences * experts).view({2, sequences, experts});
    const double all_positions = static_cast<double>(length * shards);
    const at::Tensor f = s[0] * (static_cast<double>(experts) / (static_cast<double>(k) * all_positions));
    total = total + o.seq_aux_loss_coeff * (f * (s[1] / all_positions)).sum(-1).mean();
  }
  if (o.z_loss_coeff != 0) total = total + o.z_loss_coeff * (next(1)[0] / static_cast<double>(tokens * shards));
  return total;
}

void MoE::set_token_split(TokenSplit split) {
  HP_CHECK(split.shards >= 1 && (split.shards == 1 || split.sum != nullptr),
           "MoE::set_token_split: need shards >= 1 and, for more than one, a sum over them");
  token_split_ = std::move(split);
}

namespace {
thread_local double aux_loss_scale = 1.0;
}  // namespace

AuxLossScale::AuxLossScale(double scale) : previous_(aux_loss_scale) { aux_loss_scale = scale; }
AuxLossScale::~AuxLossScale() { aux_loss_scale = previous_; }
double AuxLossScale::current() { return aux_loss_scale; }

at::Tensor MoE::routed_output(const at::Tensor& tokens, const Routing& routing,
                              const std::function<void()>& while_dispatching) {
  HP_CHECK(tokens.dim() == 2 && routing.experts.dim() == 2 && routing.experts.size(0) == tokens.size(0),
           "MoE: a routing of ", routing.experts.sizes(), " for tokens of shape ", tokens.sizes());
  const int64_t dim = tokens.size(1), k = routing.experts.size(1);
  at::Tensor slot_expert = routing.experts.reshape({-1});
  at::Tensor count_tensor = routing.counts;
  CapacityOverflow overflow;
  dropped_ = 0;
  if (options_.capacity_factor > 0) {
    // A capacity reads the counts before the dispatcher does: a second host sync.
    std::vector<int64_t> counts = replayed<std::vector<int64_t>>([&] { return to_host_int64s(routing.counts); });
    const double ideal = static_cast<double>(tokens.size(0) * k) / static_cast<double>(counts.size());
    const auto capacity = static_cast<int64_t>(std::ceil(options_.capacity_factor * ideal));
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    if (options_.capacity_policy == CapacityPolicy::kError) {
      const auto worst = std::max_element(counts.begin(), counts.end());
      if (*worst > capacity) overflow = {worst - counts.begin(), *worst, capacity};
    } else {
      slot_expert = drop_over_capacity(slot_expert.clone(), routing.gates.detach().reshape({-1}), counts, capacity,
                                       options_.capacity_policy);
      dropped_ = total - std::accumulate(counts.begin(), counts.end(), int64_t{0});
      if (training_forward()) dropped_since_balance += dropped_;
    }
    count_tensor = at::tensor(counts, routing.counts.options());
  }
  // Rows grouped by expert: a stable sort of the (token, choice) slots keeps token order within
  // an expert, so an expert's rows do not depend on how the tokens were split over ranks. Dropped
  // slots sort last and are not sent.
  const at::Tensor order = std::get<1>(at::sort(slot_expert, /*stable=*/true, 0, false));
  const at::Tensor sent = order.narrow(0, 0, order.numel() - dropped_);
  at::Tensor rows = tokens.index_select(0, at::div(sent, k, "floor"));
  if (options_.gate_before_experts)
    rows = (rows.to(routing.gates.scalar_type()) * routing.gates.reshape({-1}).index_select(0, sent).unsqueeze(1))
               .to(tokens.scalar_type());
  at::Tensor out_rows = dispatcher_->run(
      rows, count_tensor,
      [this](const at::Tensor& r, const std::vector<int64_t>& c) { return (*experts)(r, at::tensor(c, at::kLong)); },
      overflow, while_dispatching);
  if (dropped_ > 0) out_rows = at::cat({out_rows, at::zeros({dropped_, dim}, out_rows.options())});
  // Back to (token, choice) order; a token's k outputs are summed in choice order.
  const at::Tensor row_of_slot = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()));
  const at::Tensor by_slot = out_rows.index_select(0, row_of_slot).view({-1, k, dim});
  at::Tensor out;
  for (int64_t j = 0; j < k; ++j) {
    at::Tensor term = by_slot.select(1, j);
    if (!options_.gate_before_experts)
      term = (term.to(routing.gates.scalar_type()) * routing.gates.select(1, j).unsqueeze(1)).to(tokens.scalar_type());
    out = j == 0 ? term : out + term;
  }
  return out;
}

std::optional<CapacityPolicy> capacity_policy_named(const std::string& name) {
  if (name == "error") return CapacityPolicy::kError;
  if (name == "drop_lowest") return CapacityPolicy::kDropLowest;
  if (name == "drop_last") return CapacityPolicy::kDropLast;
  return std::nullopt;
}

std::string CapacityOverflow::str() const {
  std::ostringstream out;
  out << "expert " << expert << " got " << rows << " rows, over its capacity of " << capacity
      << " (raise capacity_factor, or choose a policy that drops rows)";
  return out.str();
}

// ---- load balancing ----------------------------------------------------------------------------

std::vector<std::pair<std::string, TokenChoiceTopKRouter*>> routers_of(Module& model) {
  std::vector<std::pair<std::string, TokenChoiceTopKRouter*>> routers;
  for (auto& [fqn, m] : model.named_modules_fqn())
    if (auto* router = dynamic_cast<TokenChoiceTopKRouter*>(m)) routers.emplace_back(fqn, router);
  return routers;
}

std::vector<ExpertLoad> balance_experts(Module& model, double rate,
                                        const std::function<void(at::Tensor& counts)>& sum_over_data_ranks) {
  HP_CHECK(rate >= 0.0, "balance_experts: the rate must be >= 0, got ", rate);
  // Every router, with the MoE layer it belongs to (null for a router on its own).
  struct Entry {
    std::string fqn;
    TokenChoiceTopKRouter* router;
    MoE* layer = nullptr;
  };
  std::vector<Entry> entries;
  for (const auto& [fqn, router] : routers_of(model)) entries.push_back({fqn, router});
  std::map<const TokenChoiceTopKRouter*, MoE*> layer_of;
  for (auto& [fqn, m] : model.named_modules_fqn())
    if (auto* moe = dynamic_cast<MoE*>(m)) layer_of[moe->router.get()] = moe;
  std::vector<ExpertLoad> loads;
  if (entries.empty()) return loads;
  // One reduction for all routers: each one's counts, then its layer's dropped rows, auxiliary
  // loss sum and forwards.
  std::vector<at::Tensor> each;
  for (Entry& entry : entries) {
    each.push_back(entry.router->tokens_per_expert);
    each.push_back(at::zeros({3}, at::kDouble));
    if (const auto layer = layer_of.find(entry.router); layer != layer_of.end()) {
      entry.layer = layer->second;
      each.back()[0] = static_cast<double>(entry.layer->dropped_since_balance);
      each.back()[1] = entry.layer->aux_loss_since_balance;
      each.back()[2] = static_cast<double>(entry.layer->forwards_since_balance);
    }
  }
  at::Tensor counts = at::cat(each);
  sum_over_data_ranks(counts);
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const Entry& entry : entries) {
    TokenChoiceTopKRouter& router = *entry.router;
    const int64_t experts = router.options().experts;
    const at::Tensor c = counts.narrow(0, offset, experts);
    const at::Tensor extra = counts.narrow(0, offset + experts, 3);  // dropped, aux sum, forwards
    offset += experts + 3;
    const double mean = c.mean().item<double>(), forwards = extra[2].item<double>();
    ExpertLoad load{entry.fqn, std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel())};
    load.max_over_mean = mean > 0 ? c.max().item<double>() / mean : 0.0;
    if (router.expert_bias.defined()) {
      if (rate > 0 && mean > 0) {
        router.expert_bias.add_((rate * at::sign(mean - c)).to(at::kFloat));
        router.expert_bias.sub_(router.expert_bias.mean());
      }
      load.bias_norm = router.expert_bias.norm().item<double>();
    }
    load.dropped = extra[0].item<double>();
    load.aux_loss = forwards > 0 ? extra[1].item<double>() / forwards : 0.0;
    loads.push_back(std::move(load));
  }
  forget_expert_counts(model);
  return loads;
}

void forget_expert_counts(Module& model) {
  at::NoGradGuard no_grad;
  for (const auto& [fqn, router] : routers_of(model)) router->tokens_per_expert.zero_();
  for (auto& [fqn, m] : model.named_modules_fqn())
    if (auto* moe = dynamic_cast<MoE*>(m)) {
      moe->dropped_since_balance = 0;
      moe->aux_loss_since_balance.zero_();
      moe->forwards_since_balance = 0;
    }
}

}  // namespace hp::nn
