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
  std::vector<std::vector<int64_t>> shapes;
  std::vector<at::TensorOptions> kinds;
  {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> factors;
    for (const at::Tensor& w : ws) {
      inputs.push_back(w);
      detached.push_back(w.detach());
      factors.push_back(detached.back().t());
    }
    for (const at::Tensor& y :
         comm::all_gather_matmul(group, x_shard.detach(), factors, dim, /*return_gathered=*/false).outputs) {
      ys.push_back(y.contiguous());
      shapes.push_back(y.sizes().vec());
      kinds.push_back(y.options());
    }
  }
  return record_trimmed_backward(
      "AllGatherLinearBackward", inputs, std::move(ys),
      [group, x_shard = x_shard.detach(), version = x_shard._version(), ws = std::move(detached),
       shapes = std::move(shapes), kinds = std::move(kinds),
       dim](std::vector<at::Tensor> dys, const std::vector<bool>& asked) {
        at::NoGradGuard no_grad;
        // An output that got no gradient counts as a zero one: every rank then issues the same
        // collectives whatever reached it, and every weight asked for gets a gradient (the weights
        // reach this node through ToLocal, whose backward needs one).
        for (size_t i = 0; i < ws.size(); ++i)
          if (!dys[i].defined()) dys[i] = at::zeros(shapes[i], kinds[i]);
        std::vector<at::Tensor> grads(asked.size());
        // dx = reduce_scatter(sum_i dy_i @ w_i), one fused op: the dy_i side by side times the w_i
        // stacked.
        if (asked[0])
          grads[0] = comm::matmul_reduce_scatter(group, ws.size() == 1 ? dys[0] : at::cat(dys, -1),
                                                 ws.size() == 1 ? ws[0] : at::cat(ws, 0), dim);
        if (std::any_of(asked.begin() + 1, asked.end(), [](bool a) { return a; })) {
          check_unchanged(x_shard, version, "AllGatherLinearBackward");
          const at::Tensor gathered = comm::all_gather_matmul(group, x_shard, {}, dim).gathered;
          for (size_t i = 0; i < ws.size(); ++i)
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
