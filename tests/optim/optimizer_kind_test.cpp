// An optimizer hp has never seen becomes checkpointable and chainable by registering its kind, with
// no change in dcp; a ChainedOptimizer checkpoints and resumes as one optimizer.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <hp/dcp/checkpoint.h>
#include <hp/dcp/state_dict.h>
#include <hp/optim/chained.h>
#include <hp/optim/optimizer_kind.h>
#include <torch/nn/module.h>

#include "test_util.h"

namespace hp::test {
namespace {

// A made-up optimizer: v = 0.5 v + grad; p -= lr v; with a per-parameter step count.
struct HeavyBallOptions : torch::optim::OptimizerCloneableOptions<HeavyBallOptions> {
  HeavyBallOptions(double lr = 0.1) : lr_(lr) {}  // NOLINT: implicit like torch's options
  TORCH_ARG(double, lr);
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};
struct HeavyBallState : torch::optim::OptimizerCloneableParamState<HeavyBallState> {
  TORCH_ARG(at::Tensor, velocity);
  TORCH_ARG(int64_t, step) = 0;
};

class HeavyBallKind : public OptimizerKind {
 public:
  std::string name() const override { return "HeavyBall"; }
  void init_state(const torch::optim::OptimizerOptions&, const at::Tensor& p,
                  std::unique_ptr<torch::optim::OptimizerParamState>& slot) const override {
    auto s = std::make_unique<HeavyBallState>();
    s->velocity(at::zeros_like(p));
    slot = std::move(s);
  }
  ParamStateFields fields(torch::optim::OptimizerParamState& state) const override {
    auto& s = static_cast<HeavyBallState&>(state);
    return {{{"velocity", s.velocity()}}, s.step()};
  }
  void set_step(torch::optim::OptimizerParamState& state, int64_t step) const override {
    static_cast<HeavyBallState&>(state).step(step);
  }
  bool can_step_group() const override { return true; }
  void step_group(torch::optim::OptimizerParamGroup& group, OptimizerStateMap& state) const override {
    const double lr = static_cast<const HeavyBallOptions&>(group.options()).lr();
    for (const at::Tensor& p : group.params()) {
      auto& slot = state[optimizer_state_key(p)];
      if (!slot) init_state(group.options(), p, slot);
      auto& s = static_cast<HeavyBallState&>(*slot);
      s.velocity().mul_(0.5).add_(p.grad());
      s.step(s.step() + 1);
      p.detach().add_(s.velocity(), -lr);
    }
  }
};

struct TwoWeights : torch::nn::Module {
  TwoWeights() {
    a = register_parameter("a", at::arange(12, at::kFloat).reshape({3, 4}) / 7);
    b = register_parameter("b", at::arange(5, at::kFloat) / 3);
  }
  at::Tensor loss() { return (a * a).sum() + (b * b * b).sum(); }
  at::Tensor a, b;
};

// Chain: HeavyBall for `a`, AdamW for `b`.
ChainedOptimizer heavy_ball_and_adamw(TwoWeights& m) {
  using Group = torch::optim::OptimizerParamGroup;
  return ChainedOptimizer({Group({m.a}, std::make_unique<HeavyBallOptions>(0.05)),
                           Group({m.b}, std::make_unique<torch::optim::AdamWOptions>(0.01))});
}

void train(TwoWeights& m, torch::optim::Optimizer& optimizer, int steps) {
  for (int i = 0; i < steps; ++i) {
    optimizer.zero_grad();
    m.loss().backward();
    optimizer.step();
  }
}

TEST(OptimizerKind, RegisteringAKindMakesAnOptimizerCheckpointableAndChainable) {
  TwoWeights m;
  using Group = torch::optim::OptimizerParamGroup;
  expect_error([&] { ChainedOptimizer({Group({m.a}, std::make_unique<HeavyBallOptions>())}); },
               {"HeavyBallOptions", "register_optimizer_kind"});
  register_optimizer_kind(typeid(HeavyBallOptions), std::make_shared<HeavyBallKind>());

  const std::string dir = scratch_dir("optim_kind_checkpoint");
  at::Tensor want_a, want_b;
  run(1, [&](const comm::ProcessGroup& group) {
    TwoWeights trained;
    ChainedOptimizer chain = heavy_ball_and_adamw(trained);
    train(trained, chain, 2);
    auto state = dcp::model_state_dict(trained);
    dcp::add_optimizer_state(state, chain, trained);
    EXPECT_EQ(state.tensors.count("optim.a.velocity"), 1u);
    EXPECT_EQ(state.tensors.count("optim.b.exp_avg_sq"), 1u);
    EXPECT_EQ(state.values.at("optim.step").at("a").get<int64_t>(), 2);
    EXPECT_EQ(state.values.at("optim.step").at("b").get<int64_t>(), 2);
    dcp::save(state, dir, group);
    train(trained, chain, 1);
    want_a = trained.a.detach().clone(), want_b = trained.b.detach().clone();

    TwoWeights resumed;  // fresh weights and optimizer, filled from the checkpoint
    ChainedOptimizer fresh = heavy_ball_and_adamw(resumed);
    auto loaded = dcp::model_state_dict(resumed);
    dcp::add_optimizer_state(loaded, fresh, resumed);
    dcp::load(loaded, dir);
    dcp::restore_optimizer_values(loaded, fresh, resumed);
    EXPECT_EQ(static_cast<HeavyBallState&>(*fresh.state().at(optimizer_state_key(resumed.a))).step(), 2);
    train(resumed, fresh, 1);
    check_close(resumed.a.detach(), want_a, "a after the resumed step", /*bitwise=*/true);
    check_close(resumed.b.detach(), want_b, "b after the resumed step", /*bitwise=*/true);
  });
}

}  // namespace
}  // namespace hp::test
