// Redistribute: turn the local piece of a tensor laid out by one placement list into its piece
// under another, on the same mesh. Planned per mesh dim (a pure, cached planner), then run.
//
// Step kinds (the cheapest collective for each transition, DESIGN 2.3):
//   S(d) -> R     all_gather along d            P -> R     all_reduce
//   R -> S(d)     local chunk (no communication) P -> S(d)  reduce_scatter along d
//   S(d) -> S(e)  all_to_all                     R -> P     local: P(sum) keeps the value on
//                                                           mesh coordinate 0 and zeros elsewhere
// A tensor dim sharded by several mesh dims is split in mesh-dim order, so a plan first gathers
// ("unshards") such dims from the last mesh dim backwards where a change requires it, then applies
// the remaining transitions from the first mesh dim forwards.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "hp/comm/types.h"
#include "hp/dtensor/spec.h"

namespace hp {

struct RedistributeStep {
  enum class Kind { kAllGather, kChunk, kAllReduce, kReduceScatter, kAllToAll, kPartition };
  Kind kind;
  int64_t mesh_dim;
  Placement from, to;

  std::string str() const;  // "mesh dim 1: S(0) -> R (all_gather)"
  bool operator==(const RedistributeStep& o) const {
    return kind == o.kind && mesh_dim == o.mesh_dim && from == o.from && to == o.to;
  }
};

// The steps that turn placements `src` into `dst` (one per mesh dim each, shard dims already
// normalized). Pure and cached; throws hp::Error for transitions with no plan (Partial of one
// reduce op to Partial of another).
std::vector<RedistributeStep> plan_redistribute(const Placements& src, const Placements& dst);

// Runs the plan on this rank's piece `local` of a tensor laid out by `src`; returns this rank's
// piece under `dst`. Collective over the groups of the mesh dims whose placement changes: every
// rank of the mesh calls it with the same specs, in the same order. Not recorded by autograd (the
// DTensor layer differentiates redistribute at the global level). `wire`: the format its
// reductions (all_reduce, reduce_scatter) of a Partial(sum / avg) of fp32, bf16 or fp16 data carry
// (hp/comm/types.h); other reductions and other data travel in their own dtype.
at::Tensor redistribute_local(const at::Tensor& local, const DTensorSpec& src, const Placements& dst,
                              comm::WireFormat wire = comm::WireFormat::kNative);

// Moves a tensor between meshes (other ranks, other shapes, other placements) by point-to-point
// transfers: every rank of the destination receives exactly its piece, from the one source rank
// that holds each part (along replicated source mesh dims, the copy at coordinate 0).
// `local` is this rank's piece under `src` (undefined on ranks outside the source mesh). Returns
// this rank's piece under (dst_mesh, dst_placements), undefined on ranks outside the destination
// mesh. `dtype` is the tensor's (ranks outside the source mesh have no piece to read it from).
// Collective over the meshes' common world group: every world rank calls it. The source may not be
// Partial (reduce it first). Not recorded by autograd.
at::Tensor redistribute_across_meshes(const at::Tensor& local, const DTensorSpec& src, const DeviceMesh& dst_mesh,
                                      const Placements& dst_placements, at::ScalarType dtype = at::kFloat);

}  // namespace hp
