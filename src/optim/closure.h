// The closure step of a torch::optim optimizer: re-evaluates the loss with autograd on while the
// step itself runs without it.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

namespace hp::detail {

inline at::Tensor evaluate_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return at::Tensor();
  at::AutoGradMode enable(true);
  return closure();
}

}  // namespace hp::detail
