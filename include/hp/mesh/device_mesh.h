// hp::DeviceMesh: an N-D grid of ranks with named mesh dims and one process group per mesh dim.
//
// Semantics follow PyTorch's DeviceMesh. On a world of 8 with shape (2, 4) named ("dp", "tp"):
// rank 5 has coordinate (1, 1); mesh["tp"] of rank 5 holds ranks {4, 5, 6, 7}; mesh["dp"] holds {1, 5}.
//
// Collective contract: constructing a mesh and flatten() are collective over the mesh's ranks (every
// member calls them, in the same order), because they create the per-dim process groups. Groups are
// cached per rank set on the world group, so sub-meshes and repeated meshes reuse them. Indexing,
// sizes and coordinates are local (a slice naming a flattened dim reuses the group this rank's own
// flatten() made). A process outside the mesh may build it; asking it for a
// coordinate-dependent thing (group, local rank, sub-mesh) is an hp::Error.
//
// Unlike PyTorch there is no default process group: the world group is passed in explicitly, so
// several ranks can live in one process (see hp/testing/run_ranks.h).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hp/comm/process_group.h"

namespace at {
class Tensor;
}

namespace hp {

namespace detail {
struct MeshRoot;
}

class DeviceMesh {
 public:
  // `ranks` lists the world rank at each mesh coordinate in row-major order of `shape`.
  // Empty `dim_names` names the dims "dim0", "dim1", ...
  DeviceMesh(const comm::ProcessGroup& world, std::string device_type, std::vector<int64_t> shape,
             std::vector<int> ranks, std::vector<std::string> dim_names = {});
  // The same from an integer tensor of ranks whose shape is the mesh shape.
  DeviceMesh(const comm::ProcessGroup& world, std::string device_type, const at::Tensor& mesh,
             std::vector<std::string> dim_names = {});

  const std::string& device_type() const;
  // The device this rank computes on: the CPU, or for "cuda" the GPU LOCAL_RANK % (GPUs this process
  // sees), so ranks of a host beyond its GPUs share them (docs/gpu.md). Parameters, buffers,
  // activations and batches of a model on this mesh live there.
  c10::Device device() const;
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }  // number of ranks
  int64_t size(int64_t dim) const;
  int64_t size(const std::string& dim) const;
  const std::vector<std::string>& dim_names() const { return names_; }
  const std::vector<int>& ranks() const { return ranks_; }  // row-major
  int64_t dim_index(const std::string& name) const;

  // Sub-mesh over the named dims (in mesh order) that contains this rank. A dim flattened before
  // (flatten's name) may be named beside others: it stands for the dims it merges, which become one
  // dim of the slice, row-major, with the flattening's group.
  DeviceMesh operator[](const std::string& dim) const;
  DeviceMesh operator[](const std::vector<std::string>& dims) const;
  // mesh[{"dp", "cp"}]: without this, {"dp", "cp"} would also match std::string's iterator-pair constructor.
  DeviceMesh operator[](std::initializer_list<std::string> dims) const {
    return (*this)[std::vector<std::string>(dims)];
  }

  // A 1-D mesh over all ranks of this mesh (row-major), named `name` (default: dim names joined
  // by "_"). The name is registered on the root mesh, so root[name] works afterwards. Collective.
  DeviceMesh flatten(const std::string& name = "") const;

  int get_rank() const;                                        // this process's world rank
  const comm::ProcessGroup& world() const;                     // the world group the mesh was built from
  std::optional<std::vector<int64_t>> get_coordinate() const;  // nullopt if not in the mesh
  int64_t get_local_rank(int64_t dim) const;
  int64_t get_local_rank(const std::string& dim) const;
  const comm::ProcessGroup& get_group(int64_t dim) const;
  const comm::ProcessGroup& get_group(const std::string& dim) const;

  // The distributed RNG's state, shared by this mesh and every mesh sliced or flattened from the
  // same root (see hp/dtensor/random.h). The seed defaults to 0: never an unseeded source.
  void manual_seed(uint64_t seed) const;
  std::pair<uint64_t, uint64_t> claim_random_stream() const;  // (seed, stream); advances the stream
  // (seed, next stream), to save with a checkpoint; set_random_state puts it back.
  std::pair<uint64_t, uint64_t> random_state() const;
  void set_random_state(uint64_t seed, uint64_t next_stream) const;

  std::string str() const;  // DeviceMesh(cpu, (dp=2, tp=2), ranks=[0, 1, 2, 3])
  bool operator==(const DeviceMesh& other) const;
  bool operator!=(const DeviceMesh& other) const { return !(*this == other); }
  size_t hash() const;

 private:
  DeviceMesh(std::shared_ptr<detail::MeshRoot> root, std::vector<int64_t> shape, std::vector<int> ranks,
             std::vector<std::string> names, std::vector<comm::ProcessGroup> groups);
  const std::vector<int64_t>& coordinate_or_throw(const char* what) const;
  int64_t checked_dim(const char* what, int64_t dim) const;

  std::shared_ptr<detail::MeshRoot> root_;
  std::vector<int64_t> shape_;
  std::vector<int> ranks_;
  std::vector<std::string> names_;
  std::vector<comm::ProcessGroup> groups_;  // one per dim; empty when this rank is not in the mesh
  std::optional<std::vector<int64_t>> coordinate_;
};

// A mesh of shape `shape` over world ranks 0..N-1 in row-major order (N must be the world size).
DeviceMesh init_device_mesh(const comm::ProcessGroup& world, const std::string& device_type, std::vector<int64_t> shape,
                            std::vector<std::string> dim_names = {});

}  // namespace hp

template <>
struct std::hash<hp::DeviceMesh> {
  size_t operator()(const hp::DeviceMesh& mesh) const { return mesh.hash(); }
};
