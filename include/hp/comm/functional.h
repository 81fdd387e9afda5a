// Differentiable collectives: out-of-place versions of the ProcessGroup collectives that autograd
// can differentiate through. Each backward is the transpose collective:
//
//   forward                      backward (of the incoming gradient)
//   all_reduce(sum | avg)        all_reduce(sum | avg)
//   all_gather(dim, sizes)       reduce_scatter(sum, dim, sizes)
//   reduce_scatter(sum | avg)    all_gather (times 1/n for avg)
//   all_to_all(out, in splits)   all_to_all(in, out splits)      (the inverse permutation)
//
// Same contract as ProcessGroup: every member calls them in the same order, and therefore also
// runs backward in the same order (autograd's order is deterministic for the same graph).
// max/min reductions are not differentiable and are refused when the input requires grad.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>

#include "hp/comm/process_group.h"

namespace hp::comm::functional {

at::Tensor all_reduce(const at::Tensor& input, const ProcessGroup& group, ReduceOp op = ReduceOp::kSum);
at::Tensor all_gather(const at::Tensor& input, const ProcessGroup& group, AllGatherOptions opts = {});
at::Tensor reduce_scatter(const at::Tensor& input, const ProcessGroup& group, ReduceScatterOptions opts = {});
at::Tensor all_to_all(const at::Tensor& input, const ProcessGroup& group, AllToAllOptions opts = {});

// A differentiable collective in flight: the caller computes something else meanwhile, then wait()
// returns the output, differentiable like the blocking form's (the backward is recorded when wait()
// returns and is itself blocking). wait() once.
class PendingCollective {
 public:
  PendingCollective(Work work, std::function<at::Tensor(at::Tensor)> finish);
  at::Tensor wait();

 private:
  Work work_;
  std::function<at::Tensor(at::Tensor)> finish_;
};

// all_to_all, issued without waiting (e.g. a MoE dispatch that the shared experts overlap).
PendingCollective all_to_all_async(const at::Tensor& input, const ProcessGroup& group, AllToAllOptions opts = {});
// all_gather, issued without waiting (e.g. context parallelism's keys, gathered while the queries
// are computed).
PendingCollective all_gather_async(const at::Tensor& input, const ProcessGroup& group, AllGatherOptions opts = {});

}  // namespace hp::comm::functional
