#include "core/lambda_backward.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include "hp/core/error.h"

namespace hp::detail {
namespace {

class LambdaBackward final : public torch::autograd::Node {
 public:
  LambdaBackward(std::string name, BackwardFn backward) : name_(std::move(name)), backward_(std::move(backward)) {}
  std::string name() const override { return name_; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    HP_CHECK(grads[0].defined(), name_, ": backward got no gradient; every rank must take part in backward");
    return {backward_(grads[0])};
  }

 private:
  std::string name_;
  BackwardFn backward_;
};

}  // namespace

at::Tensor record_backward(const std::string& name, const at::Tensor& input, at::Tensor output, BackwardFn backward) {
  if (!input.requires_grad() || !at::GradMode::is_enabled()) return output;
  auto node = std::shared_ptr<LambdaBackward>(new LambdaBackward(name, std::move(backward)),
                                              torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(output, node);
  return output;
}

}  // namespace hp::detail
