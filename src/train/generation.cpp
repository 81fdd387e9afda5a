#include "train/generation.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

#include "hp/core/error.h"

namespace hp::train::detail {

at::Tensor generate_greedy(const std::function<at::Tensor(const at::Tensor&)>& logits_of, const at::Tensor& prompt,
                           int64_t new_tokens, int64_t max_seq) {
  HP_CHECK(prompt.dim() == 1 && prompt.scalar_type() == at::kLong && prompt.numel() > 0,
           "generate_greedy: the prompt must be a non-empty 1-D int64 tensor");
  at::NoGradGuard no_grad;
  at::Tensor tokens = prompt.clone();
  for (int64_t i = 0; i < new_tokens; ++i) {
    const int64_t n = tokens.size(0), keep = std::min(n, max_seq);
    const at::Tensor logits = logits_of(tokens.narrow(0, n - keep, keep).unsqueeze(0));
    tokens = at::cat({tokens, logits[0][keep - 1].argmax().view({1})});
  }
  return tokens;
}

}  // namespace hp::train::detail
