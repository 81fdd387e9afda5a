// get_hyper_optimizer assigns every parameter to exactly one of Muon / AdamW as the patterns say,
// one LR schedule drives both, and a step moves every parameter.
#include <hp/nn/init.h>
#include <hp/optim/adamw.h>
#include <hp/optim/chained.h>
#include <hp/optim/lr_scheduler.h>
#include <hp/parallel/loss_parallel.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "test_util.h"
#include "tp/llama_model.h"

namespace hp::test {
namespace {

TEST(ChainedOptimizer, AssignsParametersAsConfigured) {
  Llama model(LlamaConfig{});
  nn::init_parameters(model, 2);
  ChainedOptimizer chain = get_hyper_optimizer(model, {"layers.*.*.*.weight"}, {"*.weight", "layers.*.*.weight"},
                                               MuonOptions(0.02), torch::optim::AdamWOptions(1e-3));
  ASSERT_EQ(chain.param_groups().size(), 2u);
  auto ids = [](const torch::optim::OptimizerParamGroup& g) {
    std::set<const void*> out;
    for (const auto& p : g.params()) out.insert(p.unsafeGetTensorImpl());
    return out;
  };
  const auto muon = ids(chain.param_groups()[0]), adamw = ids(chain.param_groups()[1]);
  EXPECT_TRUE(dynamic_cast<MuonOptions*>(&chain.param_groups()[0].options()) != nullptr);
  EXPECT_TRUE(dynamic_cast<torch::optim::AdamWOptions*>(&chain.param_groups()[1].options()) != nullptr);
  for (const auto& item : model.named_parameters()) {
    const bool hidden_matrix =
        item.key().find("_proj") != std::string::npos || item.key().find(".mlp.") != std::string::npos;
    EXPECT_EQ(muon.count(item.value().unsafeGetTensorImpl()), hidden_matrix ? 1u : 0u) << item.key();
    EXPECT_EQ(adamw.count(item.value().unsafeGetTensorImpl()), hidden_matrix ? 0u : 1u) << item.key();
  }

  LRSchedule schedule;
  schedule.warmup_steps = 2;
  schedule.total_steps = 10;
  LRScheduler scheduler = get_hyper_lr_scheduler(chain, schedule);
  EXPECT_DOUBLE_EQ(scheduler.lr(0), 0.01);  // Muon's group
  EXPECT_DOUBLE_EQ(scheduler.lr(1), 5e-4);  // AdamW's group

  std::map<std::string, at::Tensor> before;
  for (const auto& item : model.named_parameters()) before[item.key()] = item.value().detach().clone();
  const at::Tensor tokens =
      at::randint(0, 64, {2, 8}, at::make_generator<at::CPUGeneratorImpl>(1), at::TensorOptions().dtype(at::kLong));
  chain.zero_grad();
  cross_entropy(model(tokens), tokens).backward();
  chain.step();
  scheduler.step();
  for (const auto& item : model.named_parameters())
    EXPECT_FALSE(at::equal(item.value().detach(), before[item.key()])) << item.key() << " did not move";
}

TEST(ChainedOptimizer, EveryParameterNeedsExactlyOneOptimizer) {
  Llama model(LlamaConfig{});
  expect_error([&] { get_hyper_optimizer(model, {"layers.*.*.*.weight"}, {"*.weight"}, {}, {}); },
               {"layers.0.attn_norm.weight", "neither"});
  expect_error(
      [&] {
        get_hyper_optimizer(model, {"layers.*.*.*.weight", "*.weight"}, {"*.weight", "layers.*.*.weight"}, {}, {});
      },
      {"embed.weight", "both"});
}

// The chain is one optimizer: its groups step exactly as Muon and AdamW stepping their halves
// separately (bitwise), over three steps.
TEST(ChainedOptimizer, StepsBitwiseAsItsOptimizersAlone) {
  const std::vector<std::string> hidden = {"layers.*.*.*.weight"}, other = {"*.weight", "layers.*.*.weight"};
  Llama chained_model(LlamaConfig{}), alone_model(LlamaConfig{});
  nn::init_parameters(chained_model, 3);
  nn::init_parameters(alone_model, 3);
  const auto muon_options = MuonOptions(0.02).weight_decay(0.1);
  const auto adamw_options = torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
  ChainedOptimizer chain = get_hyper_optimizer(chained_model, hidden, other, muon_options, adamw_options);
  std::vector<at::Tensor> muon_params, adamw_params;
  for (const auto& item : alone_model.named_parameters())
    (nn::fqn_matches(hidden[0], item.key()) ? muon_params : adamw_params).push_back(item.value());
  Muon muon(muon_params, muon_options);
  AdamW adamw(adamw_params, adamw_options);
  const at::Tensor tokens =
      at::randint(0, 64, {2, 8}, at::make_generator<at::CPUGeneratorImpl>(4), at::TensorOptions().dtype(at::kLong));
  for (int step = 0; step < 3; ++step) {
    chain.zero_grad();
    cross_entropy(chained_model(tokens), tokens).backward();
    chain.step();
    muon.zero_grad();
    adamw.zero_grad();
    cross_entropy(alone_model(tokens), tokens).backward();
    muon.step();
    adamw.step();
  }
  const auto alone = alone_model.named_parameters();
  for (const auto& item : chained_model.named_parameters())
    check_close(item.value().detach(), alone[item.key()].detach(), item.key() + " after 3 steps", /*bitwise=*/true);
}

TEST(ChainedOptimizer, RefusesGroupsItCannotStep) {
  const at::Tensor w = at::zeros({4, 4}).set_requires_grad(true), v = at::zeros({4}).set_requires_grad(true);
  using Group = torch::optim::OptimizerParamGroup;
  expect_error([&] { ChainedOptimizer({}); }, "at least one parameter group");
  expect_error([&] { ChainedOptimizer({Group({w})}); }, {"group 0", "no options"});
  expect_error(
      [&] {
        ChainedOptimizer(
            {Group({w}, std::make_unique<MuonOptions>(0.1)), Group({w}, std::make_unique<MuonOptions>(0.1))});
      },
      {"more than one group", "group 1"});
  expect_error([&] { ChainedOptimizer({Group({v}, std::make_unique<MuonOptions>(0.1))}); },
               {"Muon", "matrices only", "[4]"});
  expect_error([&] { ChainedOptimizer({Group({v}, std::make_unique<torch::optim::AdamOptions>(0.1))}); },
               {"group 0 is Adam's", "cannot step a single group"});
  expect_error([&] { ChainedOptimizer({Group({v}, std::make_unique<torch::optim::SGDOptions>(0.1))}); },
               {"torch::optim::SGDOptions", "register_optimizer_kind"});
}

}  // namespace
}  // namespace hp::test
