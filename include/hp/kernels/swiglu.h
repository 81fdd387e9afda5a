// SwiGLU fused: silu(gate) * up in one pass forward and one pass backward, vectorised for the CPU's
// capability (at::vec compiled for each of ATen's: default, AVX2, AVX512; picked at run time as
// LibTorch 1.13 picks its own: ATEN_CPU_CAPABILITY, else AVX2 where the CPU has it). Each element
// is computed with ATen's formulas in fp32, so for fp32 the result equals at::silu(gate) * up and
// its gradients bit for bit wherever ATen's own vector loop computes them (ATen's scalar loop, for
// the last few elements of a chunk, rounds exp differently, within an ulp). bf16 values are widened
// once and the result rounded once, where LibTorch 1.13's bf16 composition rounds after every op:
// closer to the fp32 values, within two bf16 roundings of the composition's, and twice as fast as
// rounding like it. Unlike the composition, the result does not depend on the thread count.
//
//   at::Tensor h = hp::kernels::swiglu(gate, up);   // differentiable in both
//
// Plain CPU tensors of one shape and dtype (fp32 or bf16) take the fused kernel; anything else
// (DTensors, other dtypes, broadcasting) takes at::silu(gate) * up.
#pragma once

#include <ATen/core/Tensor.h>

#include "hp/kernels/capability.h"

namespace hp::kernels {

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// Whether swiglu takes the fused kernel for these inputs.
bool swiglu_is_fused(const at::Tensor& gate, const at::Tensor& up);

}  // namespace hp::kernels
