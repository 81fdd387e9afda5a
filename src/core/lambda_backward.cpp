#include "hp/core/lambda_backward.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <optional>
#include <variant>

#include "hp/core/error.h"

namespace hp {
namespace {

// A node's lambda goes, with what it captured (saved activations, often), once autograd will not
// run the node again: after a backward that lets the graph go, or after the I pass of a split
// backward when W does not run the node (hp/core/weight_split.h).
template <typename Fn>
class ReleasableLambda {
 public:
  explicit ReleasableLambda(Fn fn) : fn_(std::move(fn)) {}
  const Fn& get(const std::string& name) const {
    HP_CHECK(fn_.has_value(), name,
             ": backward reached this node again after it was done with (a second backward without "
             "retain_graph, or a weight pass into what the input pass finished)");
    return *fn_;
  }
  void release() { fn_.reset(); }

 private:
  std::optional<Fn> fn_;
};

// Which of `node`'s inputs' gradients the running backward asks for, one flag per input.
std::vector<bool> asked_of(const torch::autograd::Node& node) {
  std::vector<bool> asked(node.num_outputs());
  for (size_t i = 0; i < asked.size(); ++i) asked[i] = node.task_should_compute_output(i);
  return asked;
}

class LambdaBackward final : public torch::autograd::Node {
 public:
  using Fn = std::variant<MultiBackwardFn, TrimmedBackwardFn>;
  LambdaBackward(std::string name, Fn backward) : name_(std::move(name)), backward_(std::move(backward)) {}
  std::string name() const override { return name_; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    HP_CHECK(grads[0].defined(), name_, ": backward got no gradient; every rank must take part in backward");
    const Fn& fn = backward_.get(name_);
    if (const auto* plain = std::get_if<MultiBackwardFn>(&fn)) return (*plain)(grads[0]);
    return std::get<TrimmedBackwardFn>(fn)(grads[0], asked_of(*this));
  }
  void release_variables() override { backward_.release(); }

 private:
  std::string name_;
  ReleasableLambda<Fn> backward_;
};

class ManyToManyBackward final : public torch::autograd::Node {
 public:
  using Fn = std::variant<ManyToManyBackwardFn, TrimmedManyToManyBackwardFn>;
  ManyToManyBackward(std::string name, Fn backward) : name_(std::move(name)), backward_(std::move(backward)) {}
  std::string name() const override { return name_; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const Fn& fn = backward_.get(name_);
    if (const auto* plain = std::get_if<ManyToManyBackwardFn>(&fn)) return (*plain)(std::move(grads));
    return std::get<TrimmedManyToManyBackwardFn>(fn)(std::move(grads), asked_of(*this));
  }
  void release_variables() override { backward_.release(); }

 private:
  std::string name_;
  ReleasableLambda<Fn> backward_;
};

bool any_requires_grad(const std::vector<at::Tensor>& inputs) {
  return at::GradMode::is_enabled() && std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) {
           return t.defined() && t.requires_grad();
         });
}

// `output` made to depend on `inputs` through a LambdaBackward running `backward`.
template <typename Backward>
at::Tensor record_lambda(const std::string& name, const std::vector<at::Tensor>& inputs, at::Tensor output,
                         Backward backward) {
  if (!any_requires_grad(inputs)) return output;
  auto node =
      std::shared_ptr<LambdaBackward>(new LambdaBackward(name, std::move(backward)), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(output, node);
  return output;
}

// `outputs` made to depend on `inputs` through a ManyToManyBackward running `backward`.
std::vector<at::Tensor> record_many(const std::string& name, const std::vector<at::Tensor>& inputs,
                                    std::vector<at::Tensor> outputs, ManyToManyBackward::Fn backward) {
  if (!any_requires_grad(inputs)) return outputs;
  auto node = std::shared_ptr<ManyToManyBackward>(new ManyToManyBackward(name, std::move(backward)),
                                                  torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(outputs, node);
  return outputs;
}

}  // namespace

at::Tensor record_backward(const std::string& name, const std::vector<at::Tensor>& inputs, at::Tensor output,
                           MultiBackwardFn backward) {
  return record_lambda(name, inputs, std::move(output), std::move(backward));
}

at::Tensor record_trimmed_backward(const std::string& name, const std::vector<at::Tensor>& inputs, at::Tensor output,
                                   TrimmedBackwardFn backward) {
  return record_lambda(name, inputs, std::move(output), std::move(backward));
}

std::vector<at::Tensor> record_backward(const std::string& name, const std::vector<at::Tensor>& inputs,
                                        std::vector<at::Tensor> outputs, ManyToManyBackwardFn backward) {
  return record_many(name, inputs, std::move(outputs), std::move(backward));
}

std::vector<at::Tensor> record_trimmed_backward(const std::string& name, const std::vector<at::Tensor>& inputs,
                                                std::vector<at::Tensor> outputs, TrimmedManyToManyBackwardFn backward) {
  return record_many(name, inputs, std::move(outputs), std::move(backward));
}

at::Tensor record_backward(const std::string& name, const at::Tensor& input, at::Tensor output, BackwardFn backward) {
  return record_backward(
      name, std::vector<at::Tensor>{input}, std::move(output),
      [backward = std::move(backward)](const at::Tensor& grad) { return std::vector<at::Tensor>{backward(grad)}; });
}

}  // namespace hp
