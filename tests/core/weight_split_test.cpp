// The I/W split of a backward (hp/core/weight_split.h) against one plain backward: the same
// gradients, bit for bit; I frees what only it needed.
#include "hp/core/weight_split.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <utility>

#include "hp/core/lambda_backward.h"

namespace hp {
namespace {

struct Weights {
  at::Tensor w1, w2, norm;
};

Weights weights() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return {at::randn({16, 8}, gen).requires_grad_(), at::randn({8, 16}, gen).requires_grad_(),
          at::randn({8}, gen).requires_grad_()};
}

// Two products and a scale, with a weight used twice and `h` saved by sin's backward alone.
at::Tensor forward(const at::Tensor& x, const Weights& w, at::Tensor* h_out = nullptr) {
  at::Tensor h = x.mm(w.w1.t());
  if (h_out) *h_out = h;
  return (h.sin().mm(w.w2.t()) + x) * w.norm + x.mm(w.w1.t()).narrow(1, 0, 8);
}

TEST(WeightGradientSplit, IAndWGiveTheGradientsOfOnePlainBackward) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor x0 = at::randn({4, 8}, gen), grad = at::randn({4, 8}, gen);
  const Weights plain = weights(), split = weights();
  const at::Tensor x = x0.clone().requires_grad_();
  forward(x, plain).backward(grad);

  const at::Tensor xs = x0.clone().requires_grad_();
  const at::Tensor out = forward(xs, split);
  const auto s = WeightGradientSplit::prepare_for_leaves(out, {xs});
  ASSERT_NE(s, nullptr);
  const at::Tensor dx = s->input_gradients(out, {xs}, grad)[0];
  EXPECT_FALSE(split.w1.grad().defined()) << "I computed a weight gradient";
  s->weight_gradients();
  EXPECT_TRUE(at::equal(dx, x.grad()));
  EXPECT_TRUE(at::equal(split.w1.grad(), plain.w1.grad()));
  EXPECT_TRUE(at::equal(split.w2.grad(), plain.w2.grad()));
  EXPECT_TRUE(at::equal(split.norm.grad(), plain.norm.grad()));
}

// What a node on the path from output to input saved without a branch toward a weight (sin's
// input, what a lambda node captured) is freed when I ends; W never runs those nodes.
TEST(WeightGradientSplit, IFreesWhatOnlyItNeeded) {
  using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  const Weights w = weights();
  const at::Tensor x = at::randn({4, 8}).requires_grad_();
  at::Tensor h, scale = at::full({4, 8}, 3.0);
  const at::Tensor y = forward(x, w, &h);
  const WeakTensor sin_input(h.getIntrusivePtr()), captured(scale.getIntrusivePtr());
  h.reset();
  at::Tensor scaled = (y * scale).detach();
  const at::Tensor out =
      record_backward("scale", y, std::move(scaled),
                      [scale = std::exchange(scale, at::Tensor())](const at::Tensor& grad) { return grad * scale; });
  const auto s = WeightGradientSplit::prepare(out, x, {w.w1, w.w2, w.norm});
  ASSERT_NE(s, nullptr);
  EXPECT_FALSE(sin_input.expired() || captured.expired()) << "the nodes keep them until I";
  s->input_gradient(out, x, at::ones_like(out));
  EXPECT_TRUE(sin_input.expired()) << "sin's input outlived I";
  EXPECT_TRUE(captured.expired()) << "what the lambda node captured outlived I";
  s->weight_gradients();
  EXPECT_TRUE(w.w1.grad().defined() && w.w2.grad().defined() && w.norm.grad().defined());
}

// A node that computes all its gradients at once (hp::record_trimmed_backward) is asked in I for
// its input's alone and in W for its weight's alone.
TEST(WeightGradientSplit, ALambdaNodeIsAskedForWhatEachPassNeeds) {
  const Weights w = weights();
  const at::Tensor x = at::randn({4, 8}).requires_grad_();
  std::vector<std::vector<bool>> asks;
  const at::Tensor y = record_trimmed_backward(
      "scale", {x, w.norm}, (x * w.norm).detach(), [&](const at::Tensor& grad, const std::vector<bool>& asked) {
        asks.push_back(asked);
        return std::vector<at::Tensor>{asked[0] ? grad * w.norm.detach() : at::Tensor(),
                                       asked[1] ? (grad * x.detach()).sum(0) : at::Tensor()};
      });
  const at::Tensor out = y.mm(w.w1.t());
  const auto s = WeightGradientSplit::prepare(out, x, {w.w1, w.norm});
  ASSERT_NE(s, nullptr);
  const at::Tensor dx = s->input_gradient(out, x, at::ones_like(out));
  s->weight_gradients();
  ASSERT_EQ(asks.size(), 2u);
  EXPECT_EQ(asks[0], (std::vector<bool>{true, false})) << "I";
  EXPECT_EQ(asks[1], (std::vector<bool>{false, true})) << "W";
  const at::Tensor dy = at::ones_like(out).mm(w.w1.detach());
  EXPECT_TRUE(at::allclose(dx, dy * w.norm.detach()));
  EXPECT_TRUE(at::allclose(w.norm.grad(), (dy * x.detach()).sum(0)));
}

}  // namespace
}  // namespace hp
