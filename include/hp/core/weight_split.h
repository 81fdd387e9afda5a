// Splitting a backward into I (input gradients) and W (weight gradients) without walking the graph
// twice, as PyTorch's pipelining does (stage_backward_input / stage_backward_weight). Zero-bubble
// pipeline schedules run a stage's I and W apart (hp::pp); a checkpointed region recomputes once,
// in I, and runs its own W when the pipeline's W reaches it (hp/parallel/checkpoint.h).
//
// The autograd graph has nodes on the path from the output to the inputs (the I path) and
// branches off that path that end at parameters. Where a branch leaves the I path, the node
// computes both the input-side and the weight-side gradient. During I the engine computes only
// what leads to the inputs, so such a node skips its weight side; a pre-hook records the gradient
// the node received. W cuts the branching nodes' edges into the I path (I is done with them) and
// restarts all of them at once with the recorded gradients: each computes its weight side alone,
// and the branches below run once, summing where they join (a weight used twice, or an FSDP
// unit's gather, whose backward reduce-scatters the whole unit once).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace hp {

class WeightGradientSplit {
 public:
  // Finds where the branches toward `params` leave the path from `output` to `input` and starts
  // recording there. `input` is a leaf, or a tensor inside the graph that stands in for one (I
  // ends there and W goes on from it). Returns nullptr when there is no such path (the output does
  // not depend on the input); W then has to walk the graph once more.
  static std::shared_ptr<WeightGradientSplit> prepare(const at::Tensor& output, const at::Tensor& input,
                                                      const std::vector<at::Tensor>& params);
  // The same from several leaf `inputs`, every other leaf the output depends on counting as a
  // parameter (a recomputed region's parameters, and any it gathers from the model's). nullptr
  // when the output depends on none of the inputs.
  static std::shared_ptr<WeightGradientSplit> prepare_for_leaves(const at::Tensor& output,
                                                                 const std::vector<at::Tensor>& inputs);

  // I: the gradients of the inputs. The graph is kept for W, without what only I needed (freed
  // here): no other backward can go through it.
  at::Tensor input_gradient(const at::Tensor& output, const at::Tensor& input, const at::Tensor& grad_output);
  std::vector<at::Tensor> input_gradients(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                          const at::Tensor& grad_output);
  // W: accumulates the parameters' gradients into their .grad and frees the graph.
  void weight_gradients();

  WeightGradientSplit();
  ~WeightGradientSplit();
  WeightGradientSplit(const WeightGradientSplit&) = delete;
  WeightGradientSplit& operator=(const WeightGradientSplit&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hp
