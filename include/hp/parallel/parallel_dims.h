// Degrees of parallelism of a training run, and the device meshes they make. Knows no model: a
// model's recipe checks what its family needs (head counts divisible by tp, ...) on top.
//
//   hp::ParallelDims dims;                       // dp_replicate, dp_shard, cp, tp, pp, ep
//   dims.dp_shard = 2; dims.tp = 2;
//   dims.validate(world.size());                 // errors name the dims and the world size
//   hp::DeviceMesh mesh = hp::build_mesh(world, dims);   // (pp, dp_replicate, dp_shard, cp, tp)
//   mesh.get_local_rank("tp");                   // coordinates and sub-meshes by dim name only
//
// The dense dims multiply to the world size. Expert parallelism borrows ranks instead of adding
// them (torchtitan's rule): the ep ranks of an expert group come from dp_shard x cp x tp, and the
// experts are fully sharded over the rest, efsdp = dp_shard * cp * tp / ep.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/mesh/device_mesh.h"

namespace hp {

struct ParallelDims {
  int64_t dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1, pp = 1, ep = 1;

  // The ranks the dense dims span: pp * dp_replicate * dp_shard * cp * tp (ep borrows, it adds none).
  int64_t world_size() const { return pp * dp_replicate * dp_shard * cp * tp; }
  int64_t dp() const { return dp_replicate * dp_shard; }     // data-parallel replicas of the dense part
  int64_t efsdp() const { return dp_shard * cp * tp / ep; }  // ranks sharding each expert
  // Throws hp::Error naming the dims when one is < 1, when they do not multiply to `world_size`, or
  // when ep does not divide dp_shard * cp * tp.
  void validate(int64_t world_size) const;
  // "dp_replicate=1 dp_shard=2 tp=2 pp=1", with " cp=.." and " ep=.." when they are above 1.
  std::string str() const;
};

// The dense mesh (pp, dp_replicate, dp_shard, cp, tp) over the world, row-major: tp innermost
// (neighbouring ranks), pp outermost. Collective over `world` (every rank calls it, in the same
// order as its other collectives); creates one group per dim. `device_type`: "cpu" or "cuda".
DeviceMesh build_mesh(const comm::ProcessGroup& world, const ParallelDims& dims,
                      const std::string& device_type = "cpu");

// The expert mesh (pp, dp_replicate, efsdp, ep) on the same ranks: each dense block of
// dp_shard x cp x tp ranks re-read row-major as efsdp x ep, so an ep group takes neighbouring ranks
// (tp's first, then cp's, then dp_shard's). Collective over `world`, like build_mesh.
DeviceMesh build_expert_mesh(const comm::ProcessGroup& world, const ParallelDims& dims,
                             const std::string& device_type = "cpu");

// The mesh data-parallel training reduces gradients over: ("dp_replicate", "dp_shard") when
// dp_replicate > 1 (HSDP), else ("dp_shard"); with cp > 1, ("dp_shard", "cp") flattened to
// "dp_shard_cp" (context-parallel ranks hold the same parameters and each a share of the tokens),
// as ("dp_replicate", "dp_shard_cp") with HSDP. Collective with cp > 1.
DeviceMesh data_parallel_mesh(const DeviceMesh& mesh, const ParallelDims& dims);

// The same for the ranks that hold the same experts, on build_expert_mesh's mesh:
// ("dp_replicate", "efsdp") when dp_replicate > 1, else ("efsdp").
DeviceMesh expert_data_parallel_mesh(const DeviceMesh& expert_mesh, const ParallelDims& dims);

}  // namespace hp
