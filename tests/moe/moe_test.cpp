// The MoE building blocks on one device, against a per-token transcription of what they compute:
// the router's choices (softmax / sigmoid, renormalization, route scale, the choice-only bias,
// group-limited routing) and the layer's output, with and without shared experts.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

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
    router.param("expert_bias").copy_(bias);
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
  EXPECT_EQ(r.counts, counts) << what;
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
    for (int64_t c : moe.last_routing().counts) routed += c;
    EXPECT_EQ(routed, 60);
  }
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
