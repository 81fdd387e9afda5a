// Splitting a stage's backward into I (input gradient) and W (weight gradients) without walking the
// graph twice, as PyTorch's pipelining does (stage_backward_input / stage_backward_weight).
//
// The autograd graph of a stage has nodes on the path from its output to its input (the I path)
// and branches off that path that end at parameters. Where a branch leaves the I path, the node
// computes both the input-side and the weight-side gradient. During I the engine computes only
// what leads to the input, so such a node skips its weight side; a pre-hook records the gradient
// the node received. W then restarts from exactly those nodes with the recorded gradients and
// asks only for the parameters, so it runs the weight-side computations alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <memory>
#include <vector>

namespace hp::pp {

class WeightGradientSplit {
 public:
  // Finds where the parameters' branches leave the path from `output` to `input` and starts
  // recording there. Returns nullptr when the graph cannot be split exactly (no such path, or a
  // parameter reached from several branching nodes; see the .cpp).
  static std::shared_ptr<WeightGradientSplit> prepare(const at::Tensor& output, const at::Tensor& input,
                                                      const std::vector<at::Tensor>& params);

  // I: the gradient of `input` (the graph is kept for W).
  at::Tensor input_gradient(const at::Tensor& output, const at::Tensor& input, const at::Tensor& grad_output);
  // W: accumulates the parameters' gradients into .grad and frees the graph.
  void weight_gradients();

  struct Recorded;  // the gradients received by one branching node

 private:
  std::vector<std::shared_ptr<Recorded>> recorded_;
};

}  // namespace hp::pp
