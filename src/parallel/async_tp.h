// A Linear's matmul fused with the communication of sequence parallelism, differentiable (the
// Colwise and Rowwise styles' set_async_tp), on the fused ops of hp/comm/fused_matmul.h. `w` is
// this rank's [out, in] weight piece; `dim` the sequence dim.
//   colwise: y = all_gather(x, dim) @ w^T. Backward: dx = reduce_scatter(dy @ w, dim), fused;
//            dw = dy^T @ all_gather(x), gathered again: only x's piece is kept from forward (as
//            Megatron's sequence-parallel linear does), 1/tp of the activation.
//   rowwise: y = reduce_scatter(x @ w^T, dim). Backward: dx = all_gather(dy, dim) @ w, fused;
//            dw = all_gather(dy)^T @ x.
// A backward asked for one gradient only (the I and W passes of the zero-bubble schedules) computes
// that one; the rowwise W pass then gathers dy again.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "hp/comm/process_group.h"

namespace hp::parallel {

at::Tensor all_gather_linear(const comm::ProcessGroup& group, const at::Tensor& x_shard, const at::Tensor& w,
                             int64_t dim);
// Several colwise layers on one input (ShareInputGather: q/k/v, gate/up): y_i = all_gather(x) @ w_i^T
// with one gather. Backward: dx = reduce_scatter(sum_i dy_i @ w_i), one fused op over the dy_i
// side by side and the w_i stacked; the dw_i from one gather of x.
std::vector<at::Tensor> all_gather_linears(const comm::ProcessGroup& group, const at::Tensor& x_shard,
                                           const std::vector<at::Tensor>& ws, int64_t dim);
at::Tensor linear_reduce_scatter(const comm::ProcessGroup& group, const at::Tensor& x, const at::Tensor& w,
                                 int64_t dim);

}  // namespace hp::parallel
