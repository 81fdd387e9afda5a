// hp::DTensor: a distributed tensor that is a real at::Tensor.
//
// A DTensor's TensorImpl holds this rank's local piece and a DTensorSpec (mesh, placements, global
// shape); its sizes are the *global* sizes. It carries its own dispatch key, so every ATen op on it
// reaches one kernel that looks up the op's sharding rule, redistributes inputs where the rule
// demands, runs the op on the local pieces and wraps the results (see docs/dtensor.md). Autograd
// runs at the global level: gradients of DTensors are DTensors.
//
// Collective contract: any op on DTensors may communicate over the mesh's groups, so every rank of
// the mesh must run the same ops on the same DTensors in the same order.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "hp/comm/types.h"
#include "hp/dtensor/placement.h"
#include "hp/dtensor/spec.h"
#include "hp/mesh/device_mesh.h"

namespace hp {

class DTensor : public at::Tensor {
 public:
  // Checks that `t` is a DTensor.
  explicit DTensor(at::Tensor t);

  // Wraps this rank's piece. Without `shape`, the global shape is found by exchanging local sizes
  // along the sharded mesh dims (a collective over those groups), which also checks that the
  // pieces are the torch.chunk pieces of one tensor. Differentiable; shares `local`'s storage.
  static DTensor from_local(const at::Tensor& local, const DeviceMesh& mesh, Placements placements,
                            std::optional<std::vector<int64_t>> shape = std::nullopt);

  // This rank's piece (a view sharing storage). Differentiable: the gradient of a Partial input is
  // taken as Replicate.
  at::Tensor to_local() const;
  // The whole tensor on every rank (all_gather / all_reduce as needed). Differentiable.
  at::Tensor full_tensor() const;
  // The same tensor with other placements on the same mesh. Differentiable: the backward lays the
  // gradient out as this tensor was (a Partial gradient is reduced there), even when the placements
  // do not change. `wire`: the format the reductions of Partial(sum / avg) fp32, bf16 or fp16 data
  // carry, in forward and in that backward (hp/comm/types.h; other reductions and other data
  // travel in their own dtype).
  DTensor redistribute(const DeviceMesh& mesh, Placements placements,
                       comm::WireFormat wire = comm::WireFormat::kNative) const;

  const DTensorSpec& spec() const;
  const DeviceMesh& device_mesh() const { return spec().mesh(); }
  const Placements& placements() const { return spec().placements(); }
};

bool is_dtensor(const at::Tensor& t);

// Cuts this rank's piece out of `global` (which every rank holds in full) with no communication.
// Partial placements are not accepted here (a full tensor is not a partial value).
DTensor distribute_tensor(const at::Tensor& global, const DeviceMesh& mesh, Placements placements);

}  // namespace hp
