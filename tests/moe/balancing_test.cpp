// Auxiliary-loss-free load balancing: the sign rule, what counts, the bias on every rank and for
// every split of the tokens, and balance reached from a router that favours one expert.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <mutex>

#include "hp/nn/init.h"
#include "hp/nn/moe.h"
#include "test_util.h"

namespace hp::test {
namespace {

at::Tensor tokens(int64_t n, int64_t dim, uint64_t seed) {
  return at::randn({n, dim}, at::make_generator<at::CPUGeneratorImpl>(seed));
}

nn::RouterOptions biased(int64_t experts, int64_t top_k) {
  nn::RouterOptions o;
  o.experts = experts;
  o.top_k = top_k;
  o.expert_bias = true;
  return o;
}

TEST(Balancing, TheBiasFollowsTheSignRuleAndOnlyTrainingForwardsCount) {
  nn::TokenChoiceTopKRouter router(8, biased(4, 1));
  nn::init_parameters(router, 2);
  const nn::Routing a = router.route(tokens(24, 8, 1)), b = router.route(tokens(16, 8, 2));
  {
    at::NoGradGuard evaluation;
    router.route(tokens(50, 8, 3));  // not counted
  }
  std::vector<double> counts(4);
  for (int64_t e = 0; e < 4; ++e) counts[e] = static_cast<double>((a.counts[e] + b.counts[e]).item<int64_t>());
  const double mean = 10.0;  // 40 rows over 4 experts
  std::vector<double> want(4);
  double want_mean = 0.0;
  for (int64_t e = 0; e < 4; ++e) want_mean += (want[e] = 0.1 * ((mean > counts[e]) - (mean < counts[e]))) / 4;
  int calls = 0;
  const auto loads = nn::balance_experts(router, 0.1, [&](at::Tensor& c) {
    ++calls;
    std::vector<double> sent = counts;
    sent.insert(sent.end(), {0.0, 0.0, 0.0});  // a router outside a MoE: no dropped rows, aux losses, forwards
    EXPECT_EQ(std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel()), sent);
  });
  EXPECT_EQ(calls, 1);
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_EQ(loads[0].counts, counts);
  EXPECT_DOUBLE_EQ(loads[0].max_over_mean, *std::max_element(counts.begin(), counts.end()) / mean);
  for (int64_t e = 0; e < 4; ++e) EXPECT_NEAR(router.expert_bias[e].item<float>(), want[e] - want_mean, 1e-7);
  EXPECT_NEAR(router.expert_bias.sum().item<float>(), 0.0, 1e-6);
  EXPECT_EQ(router.tokens_per_expert.sum().item<double>(), 0.0) << "the counts restart";
  test::expect_error([&] { nn::balance_experts(router, -1.0, [](at::Tensor&) {}); }, "the rate must be >= 0");
}

// 4 ranks each routing 16 tokens per step, in one micro-batch or four, and one device routing the
// 64 concatenated: after 10 steps every bias is the same, bitwise, with zero mean.
TEST(Balancing, TheBiasIsTheSameOnEveryRankAndForEverySplitOfTheTokens) {
  const auto run = [](int world, int64_t micro_batches) {
    std::vector<at::Tensor> biases(world);
    std::mutex mu;
    test::run(world, [&](const comm::ProcessGroup& group) {
      nn::TokenChoiceTopKRouter router(8, biased(8, 2));
      nn::init_parameters(router, 4);
      const int64_t rows = 64 / world;
      for (int64_t step = 0; step < 10; ++step) {
        const at::Tensor all = tokens(64, 8, 100 + step);
        const at::Tensor mine = all.narrow(0, group.rank() * rows, rows);
        for (const at::Tensor& micro : mine.chunk(micro_batches)) router.route(micro);
        nn::balance_experts(router, 0.05, [&](at::Tensor& c) {
          if (world > 1) group.all_reduce(c);
        });
      }
      std::lock_guard<std::mutex> lock(mu);
      biases[group.rank()] = router.expert_bias.clone();
    });
    return biases;
  };
  const at::Tensor one = run(1, 1)[0];
  EXPECT_GT(one.abs().max().item<float>(), 0.0f) << "the bias should have moved";
  EXPECT_NEAR(one.sum().item<float>(), 0.0, 1e-6);
  for (int64_t micro : {1, 4})
    for (const at::Tensor& bias : run(4, micro)) EXPECT_TRUE(at::equal(bias, one)) << micro << " micro-batches";
}

// A sigmoid router (DeepSeek-V3's scores) whose gate sends every token to expert 0 (max/mean load
// 8 with top-1 of 8) reaches max/mean <= 1.5 within 200 steps of rate 0.01 (1024 tokens a step),
// and stays there.
TEST(Balancing, ARouterFavouringOneExpertReachesBalance) {
  nn::RouterOptions o = biased(8, 1);
  o.score_func = "sigmoid";
  nn::TokenChoiceTopKRouter router(16, o);
  nn::init_parameters(router, 6);
  {
    at::NoGradGuard no_grad;
    router.gate->param("weight")[0][0].fill_(2.0);  // tokens carry +3 in feature 0: expert 0's logit ~6
  }
  std::vector<double> max_over_mean;
  for (int64_t step = 0; step < 200; ++step) {
    at::Tensor x = tokens(1024, 16, 1000 + step);
    x.select(1, 0).add_(3.0);
    router.route(x);
    max_over_mean.push_back(nn::balance_experts(router, 0.01, [](at::Tensor&) {})[0].max_over_mean);
  }
  EXPECT_GE(max_over_mean.front(), 4.0);
  int64_t first_balanced = -1;
  for (int64_t s = 0; s < 200 && first_balanced < 0; ++s)
    if (max_over_mean[s] <= 1.5) first_balanced = s + 1;
  EXPECT_GT(first_balanced, 0) << "never balanced";
  for (int64_t s = 180; s < 200; ++s) EXPECT_LE(max_over_mean[s], 1.5) << "step " << s + 1;
  std::cout << "max/mean " << max_over_mean.front() << " at step 1, <= 1.5 from step " << first_balanced << "; last "
            << max_over_mean.back() << "\n";
}

}  // namespace
}  // namespace hp::test
