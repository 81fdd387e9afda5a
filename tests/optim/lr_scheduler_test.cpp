// LR schedules: warmup then cosine / linear / WSD / constant, on every parameter group.
#include <hp/optim/lr_scheduler.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>

#include "test_util.h"

namespace hp::test {
namespace {

TEST(LRScheduler, WarmupThenCosineLinearWsdConstant) {
  torch::optim::AdamW optimizer({torch::zeros({2}, torch::requires_grad())}, torch::optim::AdamWOptions(0.1));
  LRSchedule s;
  s.warmup_steps = 4;
  s.total_steps = 14;
  s.min_lr_ratio = 0.1;
  s.decay = LRSchedule::Decay::kCosine;
  LRScheduler cosine(optimizer, s);
  EXPECT_DOUBLE_EQ(cosine.lr(), 0.1 * 0.25);  // step 0 of 4 warmup steps
  for (int i = 0; i < 3; ++i) cosine.step();
  EXPECT_DOUBLE_EQ(cosine.lr(), 0.1);  // end of warmup
  EXPECT_DOUBLE_EQ(cosine.factor(9), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 0.5)));
  EXPECT_DOUBLE_EQ(cosine.factor(14), 0.1);
  EXPECT_DOUBLE_EQ(cosine.factor(100), 0.1);  // stays at the floor

  s.decay = LRSchedule::Decay::kLinear;
  EXPECT_DOUBLE_EQ(LRScheduler(optimizer, s).factor(9), 1.0 - 0.9 * 0.5);
  s.decay = LRSchedule::Decay::kWsd;
  s.decay_fraction = 0.5;  // stable until step 7, then linear to 0.1 at 14
  LRScheduler wsd(optimizer, s);
  EXPECT_DOUBLE_EQ(wsd.factor(6), 1.0);
  EXPECT_DOUBLE_EQ(wsd.factor(7), 1.0);
  EXPECT_NEAR(wsd.factor(14), 0.1, 1e-12);
  s.decay = LRSchedule::Decay::kConstant;
  EXPECT_DOUBLE_EQ(LRScheduler(optimizer, s).factor(13), 1.0);
  EXPECT_EQ(parse_decay("wsd"), LRSchedule::Decay::kWsd);
  expect_error([] { parse_decay("exp"); }, "unknown decay 'exp'");
}

TEST(LRScheduler, ScalesEachGroupsBaseRateAndResumes) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())},
                      std::make_unique<torch::optim::AdamWOptions>(0.2));
  groups.emplace_back(std::vector<at::Tensor>{torch::zeros({1}, torch::requires_grad())},
                      std::make_unique<torch::optim::AdamWOptions>(0.02));
  torch::optim::AdamW optimizer(std::move(groups));
  LRSchedule s;
  s.warmup_steps = 2;
  s.total_steps = 10;
  LRScheduler scheduler(optimizer, s);
  EXPECT_DOUBLE_EQ(scheduler.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(scheduler.lr(1), 0.01);
  scheduler.set_step(5);  // resuming: a scheduler built on a fresh optimizer, moved to the saved step
  EXPECT_DOUBLE_EQ(scheduler.lr(1), 0.02 * scheduler.factor(5));
  expect_error([&] { scheduler.set_step(-1); }, "non-negative");
  LRSchedule bad = s;
  bad.warmup_steps = 11;
  expect_error([&] { LRScheduler(optimizer, bad); }, "warmup_steps (11) <= total_steps (10)");
}

}  // namespace
}  // namespace hp::test
