// get_hyper_optimizer assigns every parameter to exactly one of Muon / AdamW as the patterns say,
// one LR schedule drives both, and a step moves every parameter.
#include <hp/nn/init.h>
#include <hp/optim/chained.h>
#include <hp/optim/lr_scheduler.h>
#include <hp/parallel/loss_parallel.h>
#include <torch/torch.h>

#include "test_util.h"
#include "tp/llama_model.h"

namespace hp::test {
namespace {

TEST(ChainedOptimizer, AssignsParametersAsConfigured) {
  Llama model(LlamaConfig{});
  nn::init_parameters(model, 2);
  ChainedOptimizer chain = get_hyper_optimizer(model, {"layers.*.*.*.weight"}, {"*.weight", "layers.*.*.weight"},
                                               MuonOptions(0.02), torch::optim::AdamWOptions(1e-3));
  ASSERT_EQ(chain.optimizers().size(), 2u);
  auto ids = [](const torch::optim::Optimizer& o) {
    std::set<const void*> out;
    for (const auto& g : o.param_groups())
      for (const auto& p : g.params()) out.insert(p.unsafeGetTensorImpl());
    return out;
  };
  const auto muon = ids(*chain.optimizers()[0]), adamw = ids(*chain.optimizers()[1]);
  EXPECT_TRUE(dynamic_cast<Muon*>(chain.optimizers()[0].get()) != nullptr);
  for (const auto& item : model.named_parameters()) {
    const bool hidden_matrix = item.key().find("_proj") != std::string::npos || item.key().find(".mlp.") != std::string::npos;
    EXPECT_EQ(muon.count(item.value().unsafeGetTensorImpl()), hidden_matrix ? 1u : 0u) << item.key();
    EXPECT_EQ(adamw.count(item.value().unsafeGetTensorImpl()), hidden_matrix ? 0u : 1u) << item.key();
  }

  LRSchedule schedule;
  schedule.warmup_steps = 2;
  schedule.total_steps = 10;
  LRScheduler scheduler = get_hyper_lr_scheduler(chain, schedule);
  EXPECT_DOUBLE_EQ(scheduler.lr(0), 0.01);   // Muon's group
  EXPECT_DOUBLE_EQ(scheduler.lr(1), 5e-4);   // AdamW's group

  std::map<std::string, at::Tensor> before;
  for (const auto& item : model.named_parameters()) before[item.key()] = item.value().detach().clone();
  const at::Tensor tokens = at::randint(0, 64, {2, 8}, at::make_generator<at::CPUGeneratorImpl>(1), at::TensorOptions().dtype(at::kLong));
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
  expect_error([&] { get_hyper_optimizer(model, {"layers.*.*.*.weight", "*.weight"}, {"*.weight", "layers.*.*.weight"}, {}, {}); },
               {"embed.weight", "both"});
}

}  // namespace
}  // namespace hp::test
