// Loss parallel: cross-entropy over vocabulary-sharded logits without gathering them.
//
// With the LM head planned as ColwiseParallel().set_output_layouts(Shard(-1))
// .set_use_local_output(false), the logits are a DTensor split over the vocabulary. The full
// logits ([tokens, vocab], the largest activation of a small-model step) never exist on one rank:
// each rank reduces its slice to three numbers per token (max, sum of exp, the target's logit),
// combined by all_reduces of [tokens] vectors, and the backward pass (softmax minus one-hot) is
// computed on the slice too.
#pragma once

#include <ATen/core/Tensor.h>

namespace hp {

// Mean cross-entropy over targets != ignore_index. `logits` [..., vocab], `targets` [...] (int64).
// Logits that are a DTensor sharded on the last dim on a 1-D mesh take the loss-parallel path and
// give a replicated scalar DTensor; any other logits get hp::kernels::cross_entropy (the fused
// kernel for plain CPU logits, at::cross_entropy_loss otherwise).
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index = -100);

}  // namespace hp
