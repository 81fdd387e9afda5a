// hp::kernels::rope: the autograd function around the per-capability rotary loops, and the
// composition everything else takes.
#include "hp/kernels/rope.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/core/error.h"
#include "hp/core/kernel_observer.h"
#include "kernels/fusable.h"
#include "kernels/per_capability/loops.h"

namespace hp::kernels {
namespace {

// Saves only the tables: the rotation is linear in x.
struct FusedRope : torch::autograd::Function<FusedRope> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    // A dry run's tables may be broadcast rows: meta computes nothing, so no copy of them either.
    const at::Tensor in = x.contiguous(), c = x.is_meta() ? cos : cos.contiguous(),
                     s = x.is_meta() ? sin : sin.contiguous();
    at::Tensor out = at::empty_like(in);
    run_kernel("rope_forward", 2 * in.nbytes(), [&] {
      if (!in.is_meta()) loops().rope(in, c, s, in.size(1), in.size(2), /*transpose=*/false, out);
    });
    ctx->save_for_backward({c, s});
    ctx->saved_data["dtype"] = static_cast<int64_t>(in.scalar_type());
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    HP_CHECK(!at::GradMode::is_enabled(), "hp::kernels::rope: no double backward (create_graph); use rope_composed");
    const auto saved = ctx->get_saved_variables();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Tensor g = grads[0].to(dtype).contiguous();
    at::Tensor dx = at::empty_like(g);
    run_kernel("rope_backward", 2 * g.nbytes(), [&] {
      if (!g.is_meta()) loops().rope(g, saved[0], saved[1], g.size(1), g.size(2), /*transpose=*/true, dx);
    });
    return {dx, at::Tensor(), at::Tensor()};
  }
};

// fp32 table rows [seq, d] on the host, or on meta for a meta x.
bool table_rows(const at::Tensor& t, const at::Tensor& x) {
  return (t.device().is_cpu() || (t.is_meta() && x.is_meta())) && !is_dtensor(t) && t.scalar_type() == at::kFloat &&
         t.dim() == 2 && t.size(0) == x.size(1) && t.size(1) == x.size(3) && !t.requires_grad();
}

}  // namespace

bool rope_is_fused(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return fusable(x) && x.dim() == 4 && x.size(3) % 2 == 0 && table_rows(cos, x) && table_rows(sin, x);
}

at::Tensor rope_composed(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t seq = x.size(1), d = x.size(-1), half = d / 2;
  const auto rows = [&](const at::Tensor& table) { return table.to(x.device(), x.scalar_type()).view({1, seq, 1, d}); };
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * rows(cos) + rotated * rows(sin);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (!rope_is_fused(x, cos, sin) || x.numel() == 0) return rope_composed(x, cos, sin);
  return FusedRope::apply(x, cos, sin);
}

}  // namespace hp::kernels
