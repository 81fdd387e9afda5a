// Escape hatches for computations no sharding rule describes.
//
// custom_shard(fn, mesh, out_placements, in_placements): redistributes each DTensor input to
// `in_placements`, runs `fn` on the local pieces, and wraps its result as a DTensor placed
// `out_placements` (PyTorch's local_map). Differentiable when `fn` is.
//
// DFunction: a distributed autograd function. The user gives the placements the inputs must have,
// a local forward, and a local backward (from the output's local gradient to each input's local
// gradient); autograd runs it like any op. Use it when the local backward is cheaper or more exact
// than differentiating the local forward.
//
// Both are collective over the mesh (the redistributions, and from_local's shape exchange when
// `out_shape` is not given).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "hp/dtensor/dtensor.h"

namespace hp {

using LocalFn = std::function<at::Tensor(const std::vector<at::Tensor>& locals)>;

at::Tensor custom_shard(const LocalFn& fn, const DeviceMesh& mesh, Placements out_placements,
                        std::vector<Placements> in_placements, const std::vector<at::Tensor>& inputs,
                        std::optional<std::vector<int64_t>> out_shape = std::nullopt);

struct DFunction {
  std::string name = "DFunction";
  std::vector<Placements> input_placements;  // one per input
  Placements output_placements;
  LocalFn forward;
  // (local gradient of the output, local inputs) -> local gradient of each input, placed like
  // that input (Partial inputs get Replicate gradients). An undefined tensor means "no gradient".
  std::function<std::vector<at::Tensor>(const at::Tensor& grad_output, const std::vector<at::Tensor>& locals)> backward;

  at::Tensor apply(const std::vector<at::Tensor>& inputs,
                   std::optional<std::vector<int64_t>> out_shape = std::nullopt) const;
};

}  // namespace hp
