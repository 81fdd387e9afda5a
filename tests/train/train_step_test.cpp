// TrainStep on a whole model: micro-batches accumulate the gradient of the mean loss, and rows that
// do not split evenly are an error rather than silently dropped rows.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/nn/init.h"
#include "hp/nn/layers.h"
#include "hp/train/train_step.h"
#include "test_util.h"

namespace hp::train {
namespace {

models::ModelParts linear_parts() {
  models::ModelParts parts;
  auto model = std::make_shared<nn::Linear>(4, 3);
  parts.model = model;
  parts.modules = {model};
  parts.loss = [](const at::Tensor& out, const at::Tensor& target) { return at::mse_loss(out, target); };
  return parts;
}

TEST(TrainStep, MicroBatchesAccumulateTheMeanLossGradient) {
  const at::Tensor x = at::arange(24, at::kFloat).reshape({6, 4}) / 10, y = at::ones({6, 3});
  models::ModelParts whole = linear_parts(), split = linear_parts();
  nn::init_parameters(*whole.model, 1);
  nn::init_parameters(*split.model, 1);
  const double one = TrainStep(whole, {1}).forward_backward(0, x, y);
  const double three = TrainStep(split, {3}).forward_backward(0, x, y);
  EXPECT_NEAR(three, one, 1e-6 * std::abs(one));
  const auto want = whole.model->parameters(), got = split.model->parameters();
  for (size_t i = 0; i < want.size(); ++i) test::check_relative(got[i].grad(), want[i].grad(), "gradient", 1e-6);
}

TEST(TrainStep, RowsThatDoNotSplitIntoMicroBatchesAreAnError) {
  models::ModelParts parts = linear_parts();
  TrainStep step(parts, {4});
  test::expect_error(
      [&] {
        step.forward_backward(0, at::zeros({6, 4}), at::zeros({6, 3}));
      },
      "6 rows do not split into 4 equal micro-batches");
}

}  // namespace
}  // namespace hp::train
