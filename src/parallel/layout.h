// Laying out module parameters and activations on a mesh: the steps every plan (parallel styles,
// shard_module) is made of.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "hp/comm/types.h"
#include "hp/dtensor/dtensor.h"
#include "hp/nn/module.h"

namespace hp::parallel {

// `p` with a negative Shard dim counted from the end of a tensor of rank `ndim`.
Placement normalized(Placement p, int64_t ndim);
Placements normalized(Placements p, int64_t ndim);

// An activation as a DTensor: a DTensor stays as it is (it must live on `mesh`); a plain tensor is
// read as this rank's piece laid out by `layout`. When `layout` shards it, the global shape comes
// from `global_last_dim` if the caller knows it (e.g. a Linear's in_features: the local size is
// then checked against this rank's torch.chunk piece), else from a small collective exchanging
// the local sizes.
at::Tensor as_dtensor(const at::Tensor& x, const DeviceMesh& mesh, const Placements& layout, const std::string& where,
                      std::optional<int64_t> global_last_dim = std::nullopt);

// `x` (DTensor) redistributed to `desired`, then handed on as its local piece if `use_local`.
// With a `wire` other than native, the redistribution's reductions carry that format, in forward
// and in backward, and the step is recorded even where `x` already has `desired`: a gradient that
// comes back Partial is then reduced here, in `wire`, instead of natively by whatever made `x`.
at::Tensor lay_out(const at::Tensor& x, const Placements& desired, bool use_local,
                   comm::WireFormat wire = comm::WireFormat::kNative);

// Replaces parameter `name` of `module` by a DTensor placed by `placements`. A parameter without
// storage yet stays without storage (only its local shape is decided); one with values is split
// locally, no communication (every rank holds the same values after init_parameters).
void distribute_parameter(nn::Module& module, const std::string& name, const DeviceMesh& mesh,
                          const Placements& placements, const std::string& fqn);

// Replaces parameter `name` by `placed` (a DTensor of the same global shape), keeping requires_grad
// and laying out its gradients like it.
void set_placed_parameter(nn::Module& module, const std::string& name, at::Tensor placed);

// Checks that dim `dim` of a parameter or activation of size `size` divides over `ranks`.
void check_divisible(const std::string& what, int64_t size, int64_t ranks, const std::string& style);

}  // namespace hp::parallel
