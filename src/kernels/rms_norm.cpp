#include "hp/kernels/rms_norm.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/core/error.h"
#include "hp/core/kernel_observer.h"
#include "kernels/fusable.h"
#include "kernels/per_capability/loops.h"

namespace hp::kernels {
namespace {

struct FusedRMSNorm : torch::autograd::Function<FusedRMSNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    const int64_t d = weight.size(0);
    const at::Tensor rows = x.contiguous().view({-1, d}), w = weight.contiguous();
    at::Tensor out = at::empty_like(rows);
    at::Tensor rstd = at::empty({rows.size(0)}, rows.options().dtype(at::kFloat));
    run_kernel("rms_norm_forward", 2 * rows.nbytes(), [&] {
      if (!rows.is_meta()) loops().rms_norm_forward(rows, w, eps, out, rstd);
    });
    ctx->save_for_backward({rows, w, rstd});
    return out.view(x.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    HP_CHECK(!at::GradMode::is_enabled(),
             "hp::kernels::rms_norm: no double backward (create_graph); use rms_norm_composed");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &rows = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor grad = grads[0].to(rows.scalar_type()).contiguous().view(rows.sizes());
    at::Tensor dx = at::empty_like(rows), dw = at::empty_like(w);
    run_kernel("rms_norm_backward", 3 * rows.nbytes(), [&] {
      if (!rows.is_meta()) loops().rms_norm_backward(grad, rows, w, rstd, dx, dw);
    });
    return {dx.view(grads[0].sizes()), dw, at::Tensor()};
  }
};

}  // namespace

bool rms_norm_is_fused(const at::Tensor& x, const at::Tensor& weight) {
  return fusable_pair(x, weight) && weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0);
}

at::Tensor rms_norm_composed(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // In fp32 at least (bf16 inputs), in fp64 for fp64 inputs.
  const at::Tensor x32 = x.to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  const at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return normed.to(x.scalar_type()) * weight;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (!rms_norm_is_fused(x, weight)) return rms_norm_composed(x, weight, eps);
  return FusedRMSNorm::apply(x, weight, eps);
}

}  // namespace hp::kernels
