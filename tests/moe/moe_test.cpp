// The MoE building blocks on one device, against a per-token transcription of what they compute:
// the router's choices (softmax / sigmoid, renormalization, route scale, the choice-only bias,
// group-limited routing) and the layer's output, with and without shared experts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <torch/csrc/autograd/autograd.h>
#include <algorithm>
#include <cmath>

#include "hp/core/host_sync.h"
#include "hp/nn/init.h"
#include "hp/nn/moe.h"
#include "test_util.h"

namespace hp::test {
namespace {

at::Tensor tokens(int64_t n, int64_t dim, uint64_t seed) {
  return at::randn({n, dim}, at::make_generator<at::CPUGeneratorImpl>(seed));
}

// Per token: the scores, the k best experts among the allowed ones, their gate values.
struct Choice {
  std::vector<int64_t> experts;
  std::vector<float> gates;
};

Choice choose_one(const at::Tensor& scores_row, const at::Tensor& bias, const nn::RouterOptions& o) {
  std::vector<float> score(o.experts), choice(o.experts);
  for (int64_t e = 0; e < o.experts; ++e) {
    score[e] = scores_row[e].item<float>();
    choice[e] = score[e] + (bias.defined() ? bias[e].item<float>() : 0.0f);
  }
  const int64_t per_group = o.experts / o.expert_groups;
  std::vector<bool> allowed(o.experts, true);
  if (o.limited_groups < o.expert_groups) {
    std::vector<std::pair<float, int64_t>> group_score;
    for (int64_t g = 0; g < o.expert_groups; ++g) {
      std::vector<float> s(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::sort(s.rbegin(), s.rend());
      group_score.push_back({s[0] + s[1], g});
    }
    std::stable_sort(group_score.begin(), group_score.end(), [](auto a, auto b) { return a.first > b.first; });
    std::fill(allowed.begin(), allowed.end(), false);
    for (int64_t i = 0; i < o.limited_groups; ++i)
      for (int64_t e = 0; e < per_group; ++e) allowed[group_score[i].second * per_group + e] = true;
  }
  std::vector<int64_t> order;
  for (int64_t e = 0; e < o.experts; ++e)
    if (allowed[e]) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
  Choice c;
  float sum = 0;
  for (int64_t j = 0; j < o.top_k; ++j) {
    c.experts.push_back(order[j]);
    c.gates.push_back(score[order[j]]);
    sum += score[order[j]];
  }
  for (float& g : c.gates) g = static_cast<float>((o.norm_topk_prob ? g / sum : g) * o.route_scale);
  return c;
}

void expect_router_matches_per_token(nn::RouterOptions o, const std::string& what) {
  nn::TokenChoiceTopKRouter router(16, o);
  nn::init_parameters(router, 3);
  at::Tensor bias;
  if (o.expert_bias) {  // a bias large enough to change choices
    bias = at::linspace(-0.5, 0.5, o.experts);
    at::NoGradGuard no_grad;
    router.expert_bias.copy_(bias);
  }
  const at::Tensor x = tokens(40, 16, 11);
  const nn::Routing r = router.route(x);
  const at::Tensor logits = at::linear(x, router.gate->param("weight"));
  const at::Tensor scores = o.score_func == "softmax" ? at::softmax(logits, -1) : at::sigmoid(logits);
  std::vector<int64_t> counts(o.experts, 0);
  for (int64_t t = 0; t < x.size(0); ++t) {
    const Choice want = choose_one(scores[t], bias, o);
    for (int64_t j = 0; j < o.top_k; ++j) {
      ASSERT_EQ(r.experts[t][j].item<int64_t>(), want.experts[j]) << what << ": token " << t << " choice " << j;
      EXPECT_NEAR(r.gates[t][j].item<float>(), want.gates[j], 1e-6) << what << ": token " << t << " choice " << j;
      ++counts[want.experts[j]];
    }
  }
  EXPECT_EQ(to_host_int64s(r.counts), counts) << what;
}

TEST(MoE, RouterChoosesAsThePerTokenRule) {
  nn::RouterOptions o;
  o.experts = 8;
  o.top_k = 2;
  expect_router_matches_per_token(o, "softmax top-2");
  o.norm_topk_prob = true;
  o.route_scale = 2.5;
  expect_router_matches_per_token(o, "softmax, renormalized, scaled");
  o.score_func = "sigmoid";
  o.expert_bias = true;
  expect_router_matches_per_token(o, "sigmoid with a choice-only bias");
  o.expert_groups = 4;
  o.limited_groups = 2;
  o.top_k = 3;
  expect_router_matches_per_token(o, "group-limited, 2 of 4 groups");
}

TEST(MoE, BadRouterOptionsAreErrors) {
  nn::RouterOptions o;
  o.top_k = 9;
  expect_error([&] { nn::TokenChoiceTopKRouter(8, o); }, "top_k (9) <= experts (8)");
  o.top_k = 2;
  o.score_func = "tanh";
  expect_error([&] { nn::TokenChoiceTopKRouter(8, o); }, "score_func 'tanh'");
  o.score_func = "softmax";
  o.expert_groups = 3;
  expect_error([&] { nn::TokenChoiceTopKRouter(8, o); }, "expert_groups (3)");
}

// On the meta device (a dry run) there are no scores: the router takes its counts from a routing
// model, checked, chooses experts of the right shape, and counts nothing for balancing. (The whole
// layer on meta runs in the dry run's tests, whose dispatch mode gives index_select a shape.)
TEST(MoE, OnTheMetaDeviceARoutingModelGivesTheCounts) {
  nn::RouterOptions o;
  o.experts = 4;
  o.top_k = 2;
  o.expert_bias = true;
  nn::TokenChoiceTopKRouter router(8, o);
  const nn::MetaParametersAllowed meta;
  nn::init_parameters(router, 1, at::kMeta);
  const at::Tensor x = at::empty({6, 8}, at::TensorOptions().device(at::kMeta)).requires_grad_();
  expect_error([&] { router.route(x); }, "tokens on the meta device have no scores to route by");
  router.set_modelled_counts([](int64_t tokens) { return std::vector<int64_t>{tokens, tokens, 0, 1}; });
  expect_error([&] { router.route(x); }, "the routing model's counts add up to 13, not 12 (6 tokens x top_k 2)");
  router.set_modelled_counts([](int64_t tokens) { return std::vector<int64_t>{tokens + 1, tokens - 1, 0, 0}; });
  expect_error([&] { router.route(x); }, "a count outside [0, 6]");
  router.set_modelled_counts([](int64_t) { return std::vector<int64_t>{12}; });
  expect_error([&] { router.route(x); }, "gave 1 counts for 4 experts");
  router.set_modelled_counts([](int64_t tokens) { return std::vector<int64_t>{tokens, tokens / 2, tokens / 2, 0}; });
  const nn::Routing r = router.route(x);
  EXPECT_TRUE(r.experts.is_meta());
  EXPECT_EQ(r.experts.sizes(), (std::vector<int64_t>{6, 2}));
  EXPECT_TRUE(r.gates.is_meta());
  EXPECT_EQ(to_host_int64s(r.counts), (std::vector<int64_t>{6, 3, 3, 0}));
  EXPECT_EQ(router.tokens_per_expert.sum().item<double>(), 0.0);
}

// out_t = sum_j gate_tj * expert_{e_tj}(x_t) (+ shared(x_t)), one token and one expert at a time.
at::Tensor per_token_moe(nn::MoE& moe, const at::Tensor& x) {
  const nn::Routing r = moe.router->route(x);
  const at::Tensor w1 = moe.experts->param("w1"), w2 = moe.experts->param("w2"), w3 = moe.experts->param("w3");
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    at::Tensor y = at::zeros({x.size(1)});
    for (int64_t j = 0; j < r.experts.size(1); ++j) {
      const int64_t e = r.experts[t][j].item<int64_t>();
      const at::Tensor h = at::silu(at::mv(w1[e], x[t])) * at::mv(w3[e], x[t]);
      y = y + r.gates[t][j] * at::mv(w2[e], h);
    }
    rows.push_back(y);
  }
  at::Tensor out = at::stack(rows);
  if (moe.shared) out = out + (*moe.shared)(x);
  return out;
}

TEST(MoE, LayerComputesThePerTokenSum) {
  for (const bool shared : {false, true}) {
    nn::MoEOptions o;
    o.router.experts = 6;
    o.router.top_k = 2;
    o.router.norm_topk_prob = true;
    o.hidden = 12;
    o.shared_hidden = shared ? 10 : 0;
    nn::MoE moe(16, o);
    nn::init_parameters(moe, 5);
    const at::Tensor x = tokens(30, 16, 2);
    const at::Tensor got = moe(x.view({3, 10, 16}));
    EXPECT_EQ(got.sizes(), (std::vector<int64_t>{3, 10, 16}));
    check_relative(got.view({30, 16}), per_token_moe(moe, x), shared ? "with shared experts" : "routed only", 1e-5);
    int64_t routed = 0;
    for (int64_t c : to_host_int64s(moe.last_routing().counts)) routed += c;
    EXPECT_EQ(routed, 60);
  }
}

// 16 tokens, top-1 of 4 experts, expert 0 chosen by 10 of them: capacity_factor 1 gives each
// expert ceil(16 / 4) = 4 rows. The drop policies keep exactly 4 of expert 0's rows (the first 4 in
// token order, or the 4 with the highest gates), whose outputs equal the dropless layer's; the 6
// dropped tokens get 0 (only the residual). The error policy names the expert, its rows and the
// capacity.
TEST(MoE, CapacityPoliciesKeepExactlyTheCapacity) {
  nn::MoEOptions o;
  o.router.experts = 4;
  o.router.top_k = 1;
  o.hidden = 8;
  nn::MoE moe(6, o);
  nn::init_parameters(moe, 9);
  const at::Tensor x = tokens(16, 6, 4);
  nn::Routing routing;
  const std::vector<int64_t> choice = {0, 1, 0, 0, 2, 0, 0, 3, 0, 0, 1, 0, 2, 0, 3, 0};
  routing.experts = at::tensor(choice, at::kLong).view({16, 1});
  routing.gates = at::linspace(0.9, 0.1, 16).view({16, 1});  // falling: token order is gate order reversed
  routing.counts = at::tensor({10, 2, 2, 2}, at::kLong);
  const at::Tensor dropless = moe.routed_output(x, routing);
  EXPECT_EQ(moe.last_dropped(), 0);
  const std::vector<int64_t> expert0 = {0, 2, 3, 5, 6, 8, 9, 11, 13, 15};
  // Drop last keeps expert 0's first 4 tokens; drop lowest keeps its 4 highest gates, which are
  // the same 4 here: so make the gates rise for drop lowest, to tell the policies apart.
  for (const auto policy : {nn::CapacityPolicy::kDropLast, nn::CapacityPolicy::kDropLowest}) {
    nn::MoEOptions capped = o;
    capped.capacity_factor = 1.0;
    capped.capacity_policy = policy;
    nn::MoE limited(6, capped);
    nn::init_parameters(limited, 9);
    nn::Routing r = routing;
    if (policy == nn::CapacityPolicy::kDropLowest) r.gates = at::linspace(0.1, 0.9, 16).view({16, 1});
    const at::Tensor reference = policy == nn::CapacityPolicy::kDropLast ? dropless : moe.routed_output(x, r);
    const at::Tensor out = limited.routed_output(x, r);
    EXPECT_EQ(limited.last_dropped(), 6);
    const std::vector<int64_t> kept = policy == nn::CapacityPolicy::kDropLast ? std::vector<int64_t>{0, 2, 3, 5}
                                                                              : std::vector<int64_t>{9, 11, 13, 15};
    for (int64_t t = 0; t < 16; ++t) {
      const bool to_expert0 = std::find(expert0.begin(), expert0.end(), t) != expert0.end();
      const bool dropped = to_expert0 && std::find(kept.begin(), kept.end(), t) == kept.end();
      if (dropped)
        EXPECT_EQ(out[t].abs().sum().item<float>(), 0.0f) << "token " << t;
      else
        check_relative(out[t], reference[t], "token " + std::to_string(t), 1e-6);
    }
  }
  nn::MoEOptions strict = o;
  strict.capacity_factor = 1.0;
  nn::MoE checked(6, strict);
  nn::init_parameters(checked, 9);
  expect_error([&] { checked.routed_output(x, routing); }, "expert 0 got 10 rows, over its capacity of 4");
  strict.capacity_factor = 2.5;  // ceil(2.5 * 4) = 10: fits
  nn::MoE roomy(6, strict);
  nn::init_parameters(roomy, 9);
  check_close(roomy.routed_output(x, routing), dropless, "within capacity", /*bitwise=*/true);
  strict.capacity_factor = -1;
  expect_error([&] { nn::MoE(6, strict); }, "capacity_factor must be >= 0");
}

// The auxiliary losses against a per-sequence transcription of their formulas (softmax and
// sigmoid scores), and their gradient: the router's gate gets exactly AuxLossScale times the
// gradient of the losses on top of the layer's own.
TEST(MoE, AuxiliaryLossesFollowTheirFormulasAndReachTheGate) {
  for (const std::string score : {"softmax", "sigmoid"}) {
    nn::MoEOptions o;
    o.router.experts = 4;
    o.router.top_k = 2;
    o.router.score_func = score;
    o.hidden = 8;
    o.aux_loss_coeff = 0.3;
    o.seq_aux_loss_coeff = 0.2;
    o.z_loss_coeff = 0.1;
    nn::MoE moe(6, o);
    nn::init_parameters(moe, 12);
    const at::Tensor x = tokens(12, 6, 5);  // 3 sequences of 4 tokens
    const nn::Routing r = moe.router->route(x);
    double want = 0.0, lse2 = 0.0;
    std::vector<double> f_all(4, 0.0), p_all(4, 0.0);
    for (int64_t b = 0; b < 3; ++b) {
      std::vector<double> f(4, 0.0), p(4, 0.0);
      for (int64_t t = b * 4; t < b * 4 + 4; ++t) {
        double sum = 0.0;
        for (int64_t e = 0; e < 4; ++e) sum += r.scores[t][e].item<double>();
        for (int64_t e = 0; e < 4; ++e) p[e] += r.scores[t][e].item<double>() / sum / 4;
        for (int64_t j = 0; j < 2; ++j) f[r.experts[t][j].item<int64_t>()] += 4.0 / (2 * 4);
        double m = 0.0;
        for (int64_t e = 0; e < 4; ++e) m += std::exp(r.logits[t][e].item<double>());
        lse2 += std::pow(std::log(m), 2) / 12;
      }
      for (int64_t e = 0; e < 4; ++e) {
        want += 0.2 * f[e] * p[e] / 3;
        f_all[e] += f[e] / 3;
        p_all[e] += p[e] / 3;
      }
    }
    for (int64_t e = 0; e < 4; ++e) want += 0.3 * f_all[e] * p_all[e];
    want += 0.1 * lse2;
    EXPECT_NEAR(moe.aux_loss(r, 3).item<double>(), want, 1e-6 * want) << score;

    // The gate's gradient: the layer's with the losses minus the layer's without them.
    const at::Tensor weight = at::randn({3, 4, 6}, at::make_generator<at::CPUGeneratorImpl>(7));
    const auto gate_grad = [&](nn::MoE& layer, double scale) {
      layer.router->gate->param("weight").mutable_grad() = at::Tensor();
      const nn::AuxLossScale scoped(scale);
      (layer(x.view({3, 4, 6})) * weight).sum().backward();
      return layer.router->gate->param("weight").grad().clone();
    };
    nn::MoEOptions plain_options = o;
    plain_options.aux_loss_coeff = plain_options.seq_aux_loss_coeff = plain_options.z_loss_coeff = 0;
    nn::MoE plain(6, plain_options);
    nn::init_parameters(plain, 12);
    const at::Tensor added = gate_grad(moe, 0.25) - gate_grad(plain, 0.25);
    const at::Tensor gate = moe.router->gate->param("weight");
    const at::Tensor direct = torch::autograd::grad({moe.aux_loss(moe.router->route(x), 3)}, {gate})[0];
    check_relative(added, 0.25 * direct, score + ": the losses' gradient in the gate", 1e-5);
  }
}

// seq_aux_loss is a mean over sequences: one micro-batch of 4 sequences (scale 1) and four of one
// (scale 1/4) give the gate the same gradient.
TEST(MoE, SeqAuxLossGradientDoesNotDependOnMicroBatching) {
  nn::MoEOptions o;
  o.router.experts = 4;
  o.router.top_k = 2;
  o.hidden = 8;
  o.seq_aux_loss_coeff = 0.5;
  nn::MoE moe(6, o);
  nn::init_parameters(moe, 13);
  const at::Tensor x = tokens(16, 6, 6).view({4, 4, 6});
  const at::Tensor gate = moe.router->gate->param("weight");
  const auto aux_grad = [&](int64_t micro) {
    gate.mutable_grad() = at::Tensor();
    const nn::AuxLossScale scoped(1.0 / static_cast<double>(micro));
    for (const at::Tensor& part : x.chunk(micro)) (moe(part) * 0.0).sum().backward();  // the losses' gradient only
    return gate.grad().clone();
  };
  const at::Tensor whole = aux_grad(1);
  EXPECT_GT(whole.abs().max().item<float>(), 0.0f);
  check_relative(aux_grad(4), whole, "4 micro-batches of one sequence", 1e-6);
}

// grouped_mm: experts with no rows are skipped, and with no rows at all the weights still get a
// (zero) gradient.
TEST(MoE, GroupedMmSkipsEmptyGroups) {
  const at::Tensor w = at::randn({3, 4, 5}, at::make_generator<at::CPUGeneratorImpl>(1)).set_requires_grad(true);
  const at::Tensor rows = at::randn({4, 5}, at::make_generator<at::CPUGeneratorImpl>(2));
  const at::Tensor out = nn::grouped_mm(rows, w, {1, 0, 3});
  check_close(out.narrow(0, 0, 1), at::mm(rows.narrow(0, 0, 1), w[0].t()), "group 0", true);
  check_close(out.narrow(0, 1, 3), at::mm(rows.narrow(0, 1, 3), w[2].t()), "group 2", true);
  const at::Tensor none = nn::grouped_mm(at::zeros({0, 5}), w, {0, 0, 0});
  EXPECT_EQ(none.sizes(), (std::vector<int64_t>{0, 4}));
  none.sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().abs().sum().item<float>(), 0.0f);
  expect_error([&] { nn::grouped_mm(rows, w, {1, 1, 1}); }, "add up to 3 rows, got 4");
}

}  // namespace
}  // namespace hp::test
