#include "hp/kernels/swiglu.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/core/error.h"
#include "hp/core/kernel_observer.h"
#include "kernels/fusable.h"
#include "kernels/per_capability/loops.h"

namespace hp::kernels {
namespace {

// Saves gate and up (what silu * up's own backward keeps, less silu's output) and recomputes
// silu in backward.
struct FusedSwiGLU : torch::autograd::Function<FusedSwiGLU> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const at::Tensor g = gate.contiguous(), u = up.contiguous();
    at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
    // A dry run keeps the fused kernel's memory and bytes, not its values.
    run_kernel("swiglu_forward", 3 * g.nbytes(), [&] {
      if (!g.is_meta()) loops().swiglu_forward(g, u, out);
    });
    ctx->save_for_backward({g, u});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The backward is not itself differentiable: a second derivative would silently lose
    // SwiGLU's terms, so asking for one (create_graph) is an error.
    HP_CHECK(!at::GradMode::is_enabled(),
             "hp::kernels::swiglu: no double backward (create_graph); use at::silu(gate) * up");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
    const at::Tensor dh = grads[0].to(g.scalar_type()).contiguous();
    at::Tensor dgate = at::empty_like(g), dup = at::empty_like(u);
    run_kernel("swiglu_backward", 5 * g.nbytes(), [&] {
      if (!g.is_meta()) loops().swiglu_backward(dh, g, u, dgate, dup);
    });
    return {dgate, dup};
  }
};

}  // namespace

bool swiglu_is_fused(const at::Tensor& gate, const at::Tensor& up) {
  return fusable_pair(gate, up) && gate.sizes() == up.sizes();
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (!swiglu_is_fused(gate, up)) return at::silu(gate) * up;
  return FusedSwiGLU::apply(gate, up);
}

}  // namespace hp::kernels
