#include "parallel/async_tp.h"

#include <ATen/ATen.h>

#include <vector>

#include "hp/comm/fused_matmul.h"
#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"

namespace hp::parallel {
namespace {

// The saved input's in-place changes since forward are errors where the backward reads it (for the
// weight's gradient), as autograd's own saved tensors make them (w is not checked: FSDP refills
// weights in place between forward and backward).
void check_unchanged(const at::Tensor& saved, int64_t version, const char* node) {
  HP_CHECK(saved._version() == version, node, ": the layer's input was modified in place after the forward (version ",
           version, ", now ", saved._version(), "); its backward needs it as it was");
}

// `t` with `dim` first, as a matrix of rows (every dim but the last) by its last dim.
at::Tensor rows_with_first(const at::Tensor& t, int64_t dim) {
  const at::Tensor moved = t.movedim(dim, 0);
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < moved.dim(); ++i) rows *= moved.size(i);
  return moved.reshape({rows, moved.size(-1)});
}

// d(w) of y = g @ w^T for rows `g` of the input and `dy` of the output, in the same row order.
at::Tensor weight_gradient(const at::Tensor& dy, const at::Tensor& g, int64_t dim) {
  return rows_with_first(dy, dim).t().mm(rows_with_first(g, dim));
}

}  // namespace

at::Tensor all_gather_linear(const comm::ProcessGroup& group, const at::Tensor& x_shard, const at::Tensor& w,
                             int64_t dim) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = comm::all_gather_matmul(group, x_shard.detach(), {w.detach().t()}, dim, /*return_gathered=*/false)
            .outputs[0]
            .contiguous();
  }
  return record_trimmed_backward("AllGatherLinearBackward", {x_shard, w}, y,
                                 [group, x_shard = x_shard.detach(), version = x_shard._version(), w = w.detach(), dim](
                                     const at::Tensor& dy, const std::vector<bool>& asked) {
                                   at::NoGradGuard no_grad;
                                   at::Tensor dx, dw;
                                   if (asked[0]) dx = comm::matmul_reduce_scatter(group, dy, w, dim);
                                   if (asked[1]) {
                                     check_unchanged(x_shard, version, "AllGatherLinearBackward");
                                     dw = weight_gradient(dy, comm::all_gather_matmul(group, x_shard, {}, dim).gathered,
                                                          dim);
                                   }
                                   return std::vector<at::Tensor>{dx, dw};
                                 });
}

at::Tensor linear_reduce_scatter(const comm::ProcessGroup& group, const at::Tensor& x, const at::Tensor& w,
                                 int64_t dim) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = comm::matmul_reduce_scatter(group, x.detach(), w.detach().t(), dim).contiguous();
  }
  return record_trimmed_backward(
      "LinearReduceScatterBackward", {x, w}, y,
      [group, x = x.detach(), version = x._version(), w = w.detach(), dim](const at::Tensor& dy,
                                                                           const std::vector<bool>& asked) {
        at::NoGradGuard no_grad;
        if (asked[1]) check_unchanged(x, version, "LinearReduceScatterBackward");
        std::vector<at::Tensor> factors;
        if (asked[0]) factors.push_back(w);
        const comm::AllGatherMatmul fused = comm::all_gather_matmul(group, dy, factors, dim, asked[1]);
        return std::vector<at::Tensor>{asked[0] ? fused.outputs[0] : at::Tensor(),
                                       asked[1] ? weight_gradient(fused.gathered, x, dim) : at::Tensor()};
      });
}

}  // namespace hp::parallel
