// Autograd for collectives: each backward is the transpose collective, recorded as a lambda.
#include "hp/comm/functional.h"

#include <ATen/ATen.h>

#include "hp/core/chunking.h"
#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"

namespace hp::comm::functional {
namespace {

// Records `backward` (given a contiguous gradient) as the step from `input` to `output`, a
// collective's result computed without recording.
at::Tensor record(const char* name, const at::Tensor& input, at::Tensor output, BackwardFn backward) {
  return record_backward(name, input, std::move(output),
                         [backward](const at::Tensor& grad) { return backward(grad.contiguous()); });
}

// Runs `forward` on the detached input (the collective itself is not recorded), then records
// `backward` as the step from input to output.
at::Tensor differentiable(const char* name, const at::Tensor& input,
                          const std::function<at::Tensor(const at::Tensor&)>& forward, BackwardFn backward) {
  return record(name, input, forward(input.detach()), std::move(backward));
}

void check_linear(const char* name, const at::Tensor& input, ReduceOp op) {
  HP_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg || !input.requires_grad(), name, ": ReduceOp ", to_string(op),
           " is not differentiable; use sum or avg, or detach the input");
}

// An all_gather's backward: the reduce_scatter of the gradient, each rank's piece its input's size.
BackwardFn all_gather_backward(const ProcessGroup& group, const AllGatherOptions& opts, const at::Tensor& input) {
  return [group, opts, own = input.size(opts.dim < 0 ? opts.dim + input.dim() : opts.dim)](const at::Tensor& g) {
    std::vector<int64_t> sizes = opts.sizes;
    if (sizes.empty()) sizes.assign(group.size(), own);
    return group.reduce_scatter(g, {ReduceOp::kSum, opts.dim, sizes});
  };
}

}  // namespace

at::Tensor all_reduce(const at::Tensor& input, const ProcessGroup& group, ReduceOp op) {
  check_linear("functional::all_reduce", input, op);
  return differentiable(
      "AllReduceBackward", input, [&](const at::Tensor& x) { return group.all_reduce(x.clone(), {op}); },
      [group, op](const at::Tensor& g) { return group.all_reduce(g.clone(), {op}); });
}

at::Tensor all_gather(const at::Tensor& input, const ProcessGroup& group, AllGatherOptions opts) {
  // Blocking (not all_gather_async's wait): a transport may then run it on the caller's thread.
  return differentiable(
      "AllGatherBackward", input, [&](const at::Tensor& x) { return group.all_gather(x, opts); },
      all_gather_backward(group, opts, input));
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
  return all_to_all_async(input, group, std::move(opts)).wait();
}

PendingCollective::PendingCollective(Work work, std::function<at::Tensor(at::Tensor)> finish)
    : work_(std::move(work)), finish_(std::move(finish)) {}

at::Tensor PendingCollective::wait() {
  HP_CHECK(finish_ != nullptr, "PendingCollective::wait: called twice");
  const auto finish = std::move(finish_);
  finish_ = nullptr;
  return finish(work_.wait());
}

PendingCollective all_to_all_async(const at::Tensor& input, const ProcessGroup& group, AllToAllOptions opts) {
  Work work = group.all_to_all_async(input.detach(), opts);
  // The backward is the all_to_all with the splits swapped.
  BackwardFn backward = [group, inverse = AllToAllOptions{opts.input_split_sizes, opts.output_split_sizes}](
                            const at::Tensor& g) { return group.all_to_all(g, inverse); };
  return PendingCollective(std::move(work), [input, backward = std::move(backward)](at::Tensor output) {
    return record("AllToAllBackward", input, std::move(output), backward);
  });
}

PendingCollective all_gather_async(const at::Tensor& input, const ProcessGroup& group, AllGatherOptions opts) {
  Work work = group.all_gather_async(input.detach(), opts);
  BackwardFn backward = all_gather_backward(group, opts, input);
  return PendingCollective(std::move(work), [input, backward = std::move(backward)](at::Tensor output) {
    return record("AllGatherBackward", input, std::move(output), backward);
  });
}

}  // namespace hp::comm::functional
