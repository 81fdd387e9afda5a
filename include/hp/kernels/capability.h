// Which vectorised copy hp's CPU kernels run: each is compiled for ATen's default, AVX2 and AVX512
// capabilities and picked at run time as LibTorch 1.13 picks its own (ATEN_CPU_CAPABILITY if set,
// else AVX2 where the CPU has it; a capability the CPU lacks falls back to the best it has).
#pragma once

namespace hp::kernels {

// The capability the kernels run at: "default", "avx2" or "avx512".
const char* kernel_capability();

// Whether the kernels run fused (the default). While any ComposedKernelsScope lives, every kernel
// takes its ATen composition instead, in every thread: for comparing a model with the kernels
// against the same model without them (tests, benchmarks). Open it while no kernel runs.
bool fused_kernels_enabled();

class ComposedKernelsScope {
 public:
  ComposedKernelsScope();
  ~ComposedKernelsScope();
  ComposedKernelsScope(const ComposedKernelsScope&) = delete;
  ComposedKernelsScope& operator=(const ComposedKernelsScope&) = delete;
};

}  // namespace hp::kernels
