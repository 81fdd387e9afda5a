// Which vectorised copy hp's CPU kernels run: each is compiled for ATen's default, AVX2 and AVX512
// capabilities and picked at run time as LibTorch 1.13 picks its own (ATEN_CPU_CAPABILITY if set,
// else AVX2 where the CPU has it; a capability the CPU lacks falls back to the best it has).
#pragma once

namespace hp::kernels {

// The capability the kernels run at: "default", "avx2" or "avx512".
const char* kernel_capability();

}  // namespace hp::kernels
