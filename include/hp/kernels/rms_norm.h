// RMSNorm fused: x * rsqrt(mean(x^2) + eps) * weight over the last dim: one pass over each row
// forward; backward, one pass over each row for dx and one over the columns for the weight's;
// vectorised per CPU capability (hp/kernels/capability.h). The row's statistics are fp32; bf16
// rounds the normalised row before the product with the weight, as the composition hp::nn::RMSNorm
// used does, and the result once. The backward computes in fp32 and rounds each gradient once (the
// composition rounds the bf16 products on the way). Saves x and one fp32 statistic per row, where
// the composition keeps an fp32 copy of x and the normalised row. No result depends on the thread
// count.
//
//   at::Tensor y = hp::kernels::rms_norm(x, weight, 1e-6);   // differentiable in x and weight
//
// Plain CPU tensors, x [..., d] and weight [d] of one dtype (fp32 or bf16), take the fused kernel;
// anything else (DTensors, fp64, mixed dtypes) takes the composition.
#pragma once

#include <ATen/core/Tensor.h>

#include "hp/kernels/capability.h"

namespace hp::kernels {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The composition: (x in fp32 or fp64) * rsqrt(mean(x^2) + eps), back in x's dtype, times weight.
at::Tensor rms_norm_composed(const at::Tensor& x, const at::Tensor& weight, double eps);

// Whether rms_norm takes the fused kernel for these inputs.
bool rms_norm_is_fused(const at::Tensor& x, const at::Tensor& weight);

}  // namespace hp::kernels
