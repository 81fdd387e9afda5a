#include "parallel/async_tp.h"

#include <ATen/ATen.h>

#include <algorithm>
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

std::vector<at::Tensor> all_gather_linears(const comm::ProcessGroup& group, const at::Tensor& x_shard,
                                           const std::vector<at::Tensor>& ws, int64_t dim) {
  HP_CHECK(!ws.empty(), "all_gather_linears: no weights");
  std::vector<at::Tensor> ys, inputs = {x_shard}, detached;
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> factors;
    for (const at::Tensor& w : ws) {
      inputs.push_back(w);
      detached.push_back(w.detach());
      factors.push_back(detached.back().t());
    }
    for (const at::Tensor& y :
         comm::all_gather_matmul(group, x_shard.detach(), factors, dim, /*return_gathered=*/false).outputs)
      ys.push_back(y.contiguous());
  }
  return record_trimmed_backward(
      "AllGatherLinearBackward", inputs, std::move(ys),
      [group, x_shard = x_shard.detach(), version = x_shard._version(), ws = std::move(detached), dim](
          std::vector<at::Tensor> dys, const std::vector<bool>& asked) {
        at::NoGradGuard no_grad;
        // The outputs that got a gradient (every rank's alike: the ops below are collectives). An
        // input asked for whose outputs got none gets zeros: the weights reach this node through
        // ToLocal, whose backward needs a gradient.
        std::vector<size_t> got;
        for (size_t i = 0; i < ws.size(); ++i)
          if (dys[i].defined()) got.push_back(i);
        std::vector<at::Tensor> grads(asked.size());
        for (size_t i = 0; i < ws.size(); ++i)
          if (asked[i + 1] && !dys[i].defined()) grads[i + 1] = at::zeros_like(ws[i]);
        if (got.empty()) {
          if (asked[0]) grads[0] = at::zeros_like(x_shard);
          return grads;
        }
        if (asked[0]) {
          // dx = reduce_scatter(sum_i dy_i @ w_i), one fused op: the dy_i side by side times the
          // w_i stacked.
          std::vector<at::Tensor> dy_parts, w_parts;
          for (size_t i : got) {
            dy_parts.push_back(dys[i]);
            w_parts.push_back(ws[i]);
          }
          grads[0] = comm::matmul_reduce_scatter(group, got.size() == 1 ? dy_parts[0] : at::cat(dy_parts, -1),
                                                 got.size() == 1 ? w_parts[0] : at::cat(w_parts, 0), dim);
        }
        const bool weights = std::any_of(got.begin(), got.end(), [&](size_t i) { return asked[i + 1]; });
        if (weights) {
          check_unchanged(x_shard, version, "AllGatherLinearBackward");
          const at::Tensor gathered = comm::all_gather_matmul(group, x_shard, {}, dim).gathered;
          for (size_t i : got)
            if (asked[i + 1]) grads[i + 1] = weight_gradient(dys[i], gathered, dim);
        }
        return grads;
      });
}

at::Tensor all_gather_linear(const comm::ProcessGroup& group, const at::Tensor& x_shard, const at::Tensor& w,
                             int64_t dim) {
  return all_gather_linears(group, x_shard, {w}, dim)[0];
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
