// The softmax of the blockwise attention kernel (hp/nn/attention.h) in one pass per row, vectorised
// per CPU capability (hp/kernels/capability.h). Not differentiable: the attention kernel writes its
// own backward, and uses softmax_scores_grad for the softmax's part of it.
//
//   at::Tensor lse;                                                  // undefined: computed
//   at::Tensor probs = hp::kernels::masked_softmax(scores, visible, scale, lse);
//
// scores [n, rows, keys] (fp32 or bf16, as the product gave them), visible int64 [rows] on the host:
// row r sees its first visible[r] keys (a causal mask over sorted positions is such a prefix).
// In fp32: s = scores * scale; lse = log(sum(exp(s - max))) + max over the visible keys (-inf for a
// row that sees none), as at::logsumexp computes it; probs = exp(s - lse) over the visible keys
// (exp(s) where lse is infinite), 0 past them. A given lse (fp32 [n, rows], e.g. the global one of
// a context-parallel ring) is used instead of computed. fp64 scores compute in fp64 by the composition. Equal to
// scaling, masking with -inf, at::logsumexp and exp within 1e-6 relative (the sums' order differs); no result depends
// on the thread count. Other devices take that composition.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "hp/kernels/capability.h"

namespace hp::kernels {

// The dtype the softmax's sums and statistics (and the attention kernel's) accumulate in: fp64 for
// fp64 inputs, else fp32.
inline at::ScalarType accumulation_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The probabilities come in `dtype` (default: fp32, fp64 for fp64 scores), rounded once from fp32
// for bf16: what casting the fp32 ones gives, without a second pass. Contiguous fp32 scores with
// fp32 probabilities are overwritten with them (no second score-sized buffer; fp64 scores too, by
// the composition); bf16 scores are only read.
// Every visible[r] must be in [0, keys].
at::Tensor masked_softmax(const at::Tensor& scores, const at::Tensor& visible, double scale, at::Tensor& lse,
                          std::optional<at::ScalarType> dtype = std::nullopt);

// The scores' gradient from the probabilities' (dprobs, which it may overwrite):
// probs * (dprobs - row) * scale, probs and dprobs [..., keys], row [...] (the softmax's
// sum(dout * out) term), all fp32 (fp64 takes the composition). Bitwise the composition's, and
// in `dtype` (default: probs'; bf16 rounded once from the fp32 result, as a cast of it would be).
at::Tensor softmax_scores_grad(const at::Tensor& probs, at::Tensor dprobs, const at::Tensor& row, double scale,
                               std::optional<at::ScalarType> dtype = std::nullopt);

}  // namespace hp::kernels
