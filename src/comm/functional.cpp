// Autograd for collectives: one small Node type whose backward is a collective given as a lambda.
#include "hp/comm/functional.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include "hp/core/chunking.h"
#include "hp/core/error.h"

namespace hp::comm::functional {
namespace {

using torch::autograd::variable_list;

// Backward node: maps the output's gradient to the input's gradient with a collective.
class CollectiveBackward final : public torch::autograd::Node {
 public:
  CollectiveBackward(std::string name, std::function<at::Tensor(const at::Tensor&)> backward)
      : name_(std::move(name)), backward_(std::move(backward)) {}

  std::string name() const override { return name_; }

  variable_list apply(variable_list&& grads) override {
    at::Tensor grad = grads[0].defined() ? grads[0].contiguous() : grads[0];
    HP_CHECK(grad.defined(), name_, ": backward got no gradient; every rank must take part in backward");
    return {backward_(grad)};
  }

 private:
  std::string name_;
  std::function<at::Tensor(const at::Tensor&)> backward_;
};

// Runs `forward` without recording, then, if `input` needs a gradient, records `backward`.
at::Tensor differentiable(const char* name, const at::Tensor& input,
                          const std::function<at::Tensor(const at::Tensor&)>& forward,
                          std::function<at::Tensor(const at::Tensor&)> backward) {
  at::Tensor output = forward(input.detach());  // detached: the collective itself is not recorded
  if (input.requires_grad() && at::GradMode::is_enabled()) {
    auto node = std::shared_ptr<CollectiveBackward>(new CollectiveBackward(name, std::move(backward)),
                                                    torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(input));
    torch::autograd::set_history(output, node);
  }
  return output;
}

void check_linear(const char* name, const at::Tensor& input, ReduceOp op) {
  HP_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg || !input.requires_grad(), name, ": ReduceOp ",
           to_string(op), " is not differentiable; use sum or avg, or detach the input");
}

}  // namespace

at::Tensor all_reduce(const at::Tensor& input, const ProcessGroup& group, ReduceOp op) {
  check_linear("functional::all_reduce", input, op);
  return differentiable(
      "AllReduceBackward", input,
      [&](const at::Tensor& x) { return group.all_reduce(x.clone(), {op}); },
      [group, op](const at::Tensor& g) { return group.all_reduce(g.clone(), {op}); });
}

at::Tensor all_gather(const at::Tensor& input, const ProcessGroup& group, AllGatherOptions opts) {
  return differentiable(
      "AllGatherBackward", input, [&](const at::Tensor& x) { return group.all_gather(x, opts); },
      [group, opts, own = input.size(opts.dim < 0 ? opts.dim + input.dim() : opts.dim)](const at::Tensor& g) {
        std::vector<int64_t> sizes = opts.sizes;
        if (sizes.empty()) sizes.assign(group.size(), own);
        return group.reduce_scatter(g, {ReduceOp::kSum, opts.dim, sizes});
      });
}

at::Tensor reduce_scatter(const at::Tensor& input, const ProcessGroup& group, ReduceScatterOptions opts) {
  check_linear("functional::reduce_scatter", input, opts.op);
  const int64_t dim = opts.dim < 0 ? opts.dim + input.dim() : opts.dim;
  std::vector<int64_t> sizes = opts.sizes.empty() ? chunk_sizes(input.size(dim), group.size()) : opts.sizes;
  return differentiable(
      "ReduceScatterBackward", input, [&](const at::Tensor& x) { return group.reduce_scatter(x, opts); },
      [group, dim, sizes, op = opts.op](const at::Tensor& g) {
        at::Tensor full = group.all_gather(g, {dim, sizes});
        return op == ReduceOp::kAvg ? full.div_(group.size()) : full;
      });
}

at::Tensor all_to_all(const at::Tensor& input, const ProcessGroup& group, AllToAllOptions opts) {
  return differentiable(
      "AllToAllBackward", input, [&](const at::Tensor& x) { return group.all_to_all(x, opts); },
      [group, inverse = AllToAllOptions{opts.input_split_sizes, opts.output_split_sizes}](const at::Tensor& g) {
        return group.all_to_all(g, inverse);
      });
}

}  // namespace hp::comm::functional
