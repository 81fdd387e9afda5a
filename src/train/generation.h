// Greedy sampling at the end of a run, through any function from tokens to logits (TrainStep::logits),
// so it knows nothing of the model or its parallel layout.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace hp::train::detail {

// Greedy continuation of `prompt` (1-D int64) by `new_tokens` tokens. `logits_of` maps tokens
// [1, seq] to plain logits [1, seq, vocab]; the context is cropped to the last `max_seq` tokens.
// Collective when logits_of is: every rank calls it with the same prompt.
at::Tensor generate_greedy(const std::function<at::Tensor(const at::Tensor&)>& logits_of, const at::Tensor& prompt,
                           int64_t new_tokens, int64_t max_seq);

}  // namespace hp::train::detail
