// bench/kernels: the fused SwiGLU (hp::kernels::swiglu) against ATen's at::silu(gate) * up, forward
// and backward, on the main job's MLP activations (16 x 128 tokens, hidden 768), fp32 and bf16,
// alternating in one run; median of the rounds, at the process's thread count.
//
//   build/bin/bench_kernels [--quick]
#include <ATen/ATen.h>

#include <cstring>
#include <iomanip>
#include <iostream>

#include "bench/timing.h"
#include "hp/core/cpu_threads.h"
#include "hp/kernels/swiglu.h"

namespace {

// Seconds of one forward and backward of f on fresh leaves.
template <typename F>
double step_seconds(const F& f, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& grad) {
  const at::Tensor g = gate.detach().requires_grad_(true), u = up.detach().requires_grad_(true);
  return hp::bench::seconds([&] { f(g, u).backward(grad); });
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int rounds = quick ? 3 : 30;
  const auto composed = [](const at::Tensor& g, const at::Tensor& u) { return at::silu(g) * u; };
  std::cout << "bench_kernels: SwiGLU forward + backward on [2048, 768], " << hp::cpu_threads()
            << " threads, capability " << hp::kernels::kernel_capability() << ", median of " << rounds << " rounds\n";
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
    const at::Tensor gate = at::randn({2048, 768}, gen).to(dtype), up = at::randn({2048, 768}, gen).to(dtype),
                     grad = at::randn({2048, 768}, gen).to(dtype);
    std::vector<double> fused, aten;
    for (int i = 0; i < rounds; ++i) {
      fused.push_back(step_seconds(hp::kernels::swiglu, gate, up, grad));
      aten.push_back(step_seconds(composed, gate, up, grad));
    }
    const double f = hp::bench::median(fused), a = hp::bench::median(aten);
    std::cout << std::fixed << std::setprecision(3) << "  " << (dtype == at::kFloat ? "fp32" : "bf16") << ": fused "
              << 1e3 * f << " ms, silu * up " << 1e3 * a << " ms, ratio " << f / a << "\n";
  }
  return 0;
}
