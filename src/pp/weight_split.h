// Splitting a stage's backward into I (input gradient) and W (weight gradients) without walking the
// graph twice, as PyTorch's pipelining does (stage_backward_input / stage_backward_weight).
//
// The autograd graph of a stage has nodes on the path from its output to its input (the I path)
// and branches off that path that end at parameters. Where a branch leaves the I path, the node
// computes both the input-side and the weight-side gradient. During I the engine computes only
// what leads to the input, so such a node skips its weight side; a pre-hook records the gradient
// the node received. W cuts the branching nodes' edges into the I path (I is done with them) and
// restarts all of them at once with the recorded gradients: each computes its weight side alone,
// and the branches below run once, summing where they join (a weight used twice, or an FSDP
// unit's gather, whose backward reduce-scatters the whole unit once).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <memory>
#include <vector>

namespace hp::pp {

class WeightGradientSplit {
 public:
  // Finds where the parameters' branches leave the path from `output` to `input` and starts
  // recording there. `input` is the stage's input (a leaf), or a tensor inside the stage that
  // stands in for it (I ends there and W goes on from it). Returns nullptr when there is no such
  // path (the output does not depend on the input); W then walks the graph once more.
  static std::shared_ptr<WeightGradientSplit> prepare(const at::Tensor& output, const at::Tensor& input,
                                                      const std::vector<at::Tensor>& params);

  // I: the gradient of `input` (the graph is kept for W).
  at::Tensor input_gradient(const at::Tensor& output, const at::Tensor& input, const at::Tensor& grad_output);
  // W: accumulates the parameters' gradients into .grad and frees the graph.
  void weight_gradients();

  struct Branching;  // one node where branches leave the I path, and what it received during I

 private:
  std::vector<std::shared_ptr<Branching>> branching_;
  std::vector<at::Tensor> params_;
  torch::autograd::Edge input_root_;  // a non-leaf input's node, with the gradient I computed for it
  at::Tensor input_root_grad_;
};

}  // namespace hp::pp
