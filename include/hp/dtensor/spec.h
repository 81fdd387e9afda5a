// DTensorSpec: where the pieces of one global tensor live: a mesh, one placement per mesh dim, and
// the global shape. Immutable value with ==, hash and str().
//
// Sharding follows PyTorch: a tensor dim sharded by several mesh dims is split by them in mesh-dim
// order (the first mesh dim splits the whole length, the next splits each piece, ...), each split
// with torch.chunk semantics.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hp/dtensor/placement.h"
#include "hp/mesh/device_mesh.h"

namespace hp {

class DTensorSpec {
 public:
  // Checks one placement per mesh dim and shard dims within the tensor's rank (negative dims are
  // normalized).
  DTensorSpec(DeviceMesh mesh, Placements placements, std::vector<int64_t> shape);

  const DeviceMesh& mesh() const { return mesh_; }
  const Placements& placements() const { return placements_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }

  // Shape and global offset of the piece held at `coordinate` (a mesh coordinate).
  std::pair<std::vector<int64_t>, std::vector<int64_t>> local_shape_and_offset(
      const std::vector<int64_t>& coordinate) const;
  // This rank's piece; an error if this rank is not in the mesh.
  std::vector<int64_t> local_shape() const;

  // A copy with other placements (same mesh and shape).
  DTensorSpec with_placements(Placements placements) const { return DTensorSpec(mesh_, std::move(placements), shape_); }

  std::string str() const;  // DTensorSpec(shape=[7, 5], [S(0), R], DeviceMesh(...))
  bool operator==(const DTensorSpec& o) const {
    return placements_ == o.placements_ && shape_ == o.shape_ && mesh_ == o.mesh_;
  }
  bool operator!=(const DTensorSpec& o) const { return !(*this == o); }
  size_t hash() const;

 private:
  DeviceMesh mesh_;
  Placements placements_;
  std::vector<int64_t> shape_;
};

// Length of tensor dim `dim` as seen at mesh dim `mesh_dim`: the global length after the splits of
// the mesh dims before `mesh_dim` that shard `dim` under `placements`, at `coordinate`.
int64_t length_at_mesh_dim(const std::vector<int64_t>& shape, const Placements& placements, const DeviceMesh& mesh,
                           const std::vector<int64_t>& coordinate, int64_t dim, int64_t mesh_dim);

}  // namespace hp

template <>
struct std::hash<hp::DTensorSpec> {
  size_t operator()(const hp::DTensorSpec& s) const { return s.hash(); }
};
