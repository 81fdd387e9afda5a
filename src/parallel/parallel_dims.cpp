#include "hp/parallel/parallel_dims.h"

#include <sstream>
#include <utility>

#include "hp/core/checked_size.h"
#include "hp/core/error.h"

namespace hp {

void ParallelDims::validate(int64_t world_size) const {
  for (auto [name, value] : {std::pair<const char*, int64_t>{"dp_replicate", dp_replicate},
                             {"dp_shard", dp_shard},
                             {"cp", cp},
                             {"tp", tp},
                             {"pp", pp},
                             {"ep", ep}})
    HP_CHECK(value >= 1, "parallel.", name, " must be >= 1, got ", value);
  HP_CHECK(checked_product({pp, dp_replicate, dp_shard, cp, tp}), "parallel dims ", str(),
           " multiply beyond 64 bits; the world has ", world_size, " ranks");
  HP_CHECK(this->world_size() == world_size, "parallel dims ", str(), " multiply to ", this->world_size(),
           " but the world has ", world_size, " ranks");
  const int64_t borrowed = dp_shard * cp * tp;
  HP_CHECK(borrowed % ep == 0, "parallel.ep (", ep, ") must divide dp_shard x cp x tp (", dp_shard, " x ", cp, " x ",
           tp, " = ", borrowed, "): expert parallelism borrows its ranks from those dims");
}

std::string ParallelDims::str() const {
  std::ostringstream out;
  out << "dp_replicate=" << dp_replicate << " dp_shard=" << dp_shard << " tp=" << tp << " pp=" << pp;
  if (cp > 1) out << " cp=" << cp;
  if (ep > 1) out << " ep=" << ep;
  return out.str();
}

DeviceMesh build_mesh(const comm::ProcessGroup& world, const ParallelDims& dims, const std::string& device_type) {
  return init_device_mesh(world, device_type, {dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp},
                          {"pp", "dp_replicate", "dp_shard", "cp", "tp"});
}

DeviceMesh build_expert_mesh(const comm::ProcessGroup& world, const ParallelDims& dims,
                             const std::string& device_type) {
  return init_device_mesh(world, device_type, {dims.pp, dims.dp_replicate, dims.efsdp(), dims.ep},
                          {"pp", "dp_replicate", "efsdp", "ep"});
}

DeviceMesh data_parallel_mesh(const DeviceMesh& mesh, const ParallelDims& dims) {
  if (dims.cp == 1) return dims.dp_replicate > 1 ? mesh[{"dp_replicate", "dp_shard"}] : mesh["dp_shard"];
  // The flattening registers "dp_shard_cp" on the root, which HSDP's 2-D slice then names.
  const DeviceMesh shard = mesh[{"dp_shard", "cp"}].flatten("dp_shard_cp");
  return dims.dp_replicate > 1 ? mesh[{"dp_replicate", "dp_shard_cp"}] : shard;
}

DeviceMesh expert_data_parallel_mesh(const DeviceMesh& expert_mesh, const ParallelDims& dims) {
  return dims.dp_replicate > 1 ? expert_mesh[{"dp_replicate", "efsdp"}] : expert_mesh["efsdp"];
}

}  // namespace hp
