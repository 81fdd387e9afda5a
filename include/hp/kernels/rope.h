// Rotary position embedding fused: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[d/2:],
// x[:d/2]), in one pass forward and one backward, vectorised per CPU capability
// (hp/kernels/capability.h). The tables stay fp32: bf16 values are widened once, rotated in fp32
// and rounded once, where the bf16 composition rounds the tables and every product and sum. No
// result depends on the thread count.
//
//   at::Tensor q_rotated = hp::kernels::rope(q, cos_rows, sin_rows);   // differentiable in q
//
// x [batch, seq, heads, d] (fp32 or bf16) on the host, cos and sin fp32 [seq, d] on the host: the
// table rows of the tokens' positions (for a dry run, all on the meta device). Anything else (DTensors, fp64,
// other devices) takes the composition, with the tables cast to x's dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include "hp/kernels/capability.h"

namespace hp::kernels {

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The composition: x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin, the tables [seq, d] in x's
// dtype and on its device, broadcast over batch and heads.
at::Tensor rope_composed(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Whether rope takes the fused kernel for these inputs.
bool rope_is_fused(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace hp::kernels
