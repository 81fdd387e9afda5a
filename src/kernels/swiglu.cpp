#include "hp/kernels/swiglu.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <string>

#include "hp/core/error.h"
#include "hp/core/kernel_observer.h"
#include "hp/dtensor/dtensor.h"
#include "kernels/per_capability/swiglu_loops.h"

namespace hp::kernels {
namespace {

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// LibTorch 1.13's rule (aten/src/ATen/native/DispatchStub.cpp): ATEN_CPU_CAPABILITY if set, else
// AVX2 where the CPU has it (AVX512 is opt-in there: it can run slower). Unlike ATen, a capability
// the CPU lacks falls back to the best it has rather than faulting.
SwigluLoops pick_loops() {
  const std::vector<SwigluLoops> runnable = runnable_swiglu_loops();
  const auto runnable_at = [&](const std::string& capability) {
    for (const SwigluLoops& loops : runnable)
      if (loops.capability == capability) return &loops;
    return static_cast<const SwigluLoops*>(nullptr);
  };
  const char* env = std::getenv("ATEN_CPU_CAPABILITY");
  const std::string asked = env != nullptr ? env : "";
  if (asked == "default") return runnable.front();
  if (asked == "avx512" && runnable_at("avx512")) return *runnable_at("avx512");
  return runnable_at("avx2") ? *runnable_at("avx2") : runnable.front();
}

const SwigluLoops& loops() {
  static const SwigluLoops picked = pick_loops();
  return picked;
}

// Saves gate and up (what silu * up's own backward keeps, less silu's output) and recomputes
// silu in backward.
struct FusedSwiGLU : torch::autograd::Function<FusedSwiGLU> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const at::Tensor g = gate.contiguous(), u = up.contiguous();
    at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
    // A dry run keeps the fused kernel's memory and bytes, not its values.
    run_kernel("swiglu_forward", 3 * g.nbytes(), [&] {
      if (!g.is_meta()) loops().forward(g, u, out);
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
      if (!g.is_meta()) loops().backward(dh, g, u, dgate, dup);
    });
    return {dgate, dup};
  }
};

}  // namespace

bool swiglu_is_fused(const at::Tensor& gate, const at::Tensor& up) {
  const auto dtype = gate.scalar_type();
  // On the meta device too: a dry run of a CPU run takes the CPU run's path (and memory).
  const auto cpu_or_meta = [](const at::Tensor& t) { return t.device().is_cpu() || t.is_meta(); };
  return cpu_or_meta(gate) && !is_dtensor(gate) && !is_dtensor(up) && gate.layout() == at::kStrided &&
         up.layout() == at::kStrided && (dtype == at::kFloat || dtype == at::kBFloat16) && up.scalar_type() == dtype &&
         gate.sizes() == up.sizes() && up.device() == gate.device();
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  if (!swiglu_is_fused(gate, up)) return at::silu(gate) * up;
  return FusedSwiGLU::apply(gate, up);
}

std::vector<SwigluLoops> runnable_swiglu_loops() {
  std::vector<SwigluLoops> out = {{"default", DEFAULT::swiglu_forward, DEFAULT::swiglu_backward}};
  if (cpu_has_avx2()) out.push_back({"avx2", AVX2::swiglu_forward, AVX2::swiglu_backward});
  if (cpu_has_avx512()) out.push_back({"avx512", AVX512::swiglu_forward, AVX512::swiglu_backward});
  return out;
}

const char* kernel_capability() { return loops().capability; }

}  // namespace hp::kernels
