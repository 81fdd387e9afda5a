// Cross-entropy over the vocabulary fused: the mean of -log_softmax(logits)[target] over the
// targets that are not ignore_index. Forward, two passes over each row (its max, then the sum of
// exponentials: the log-sum-exp, fp32) where ATen's log_softmax makes four and writes a [rows, vocab]
// result; backward, one pass writing softmax minus one-hot, times the output's gradient over the
// count, where ATen builds nll_loss's one-hot gradient and reads it back. Vectorised for the CPU's
// capability (hp/kernels/capability.h). It saves the logits and one fp32 log-sum-exp per row (the
// composition keeps log_softmax's output, the same size). bf16 logits are widened to fp32 as they
// are read, and the gradient rounded once. The mean sums the rows' losses in row order in fp64, so
// no result depends on the thread count.
//
//   at::Tensor loss = hp::kernels::cross_entropy(logits, targets);   // differentiable in logits
//
// Plain CPU (or meta: a dry run's) logits [..., vocab], fp32 or bf16, with int64 targets of the
// logits' shape less the last dim take the fused kernel; anything else (DTensors, other dtypes)
// takes the composition, as everything does under a ComposedKernelsScope.
// A target out of [0, vocab) that is not ignore_index is an error naming it; when every target is
// ignored the loss is NaN, as the composition's.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "hp/kernels/capability.h"

namespace hp::kernels {

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index = -100);

// The composition: at::cross_entropy_loss over the flattened rows, mean reduction.
at::Tensor cross_entropy_composed(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index = -100);

// Whether cross_entropy takes the fused kernel for these inputs.
bool cross_entropy_is_fused(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace hp::kernels
