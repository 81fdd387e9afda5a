// Redistribution between meshes by point-to-point transfers (see redistribute.h). Boxes are
// (offset, shape) per tensor dim in global coordinates; a transfer moves the intersection of a
// source piece's box and a destination piece's box.
#include <ATen/ATen.h>

#include "hp/core/error.h"
#include "hp/dtensor/redistribute.h"

namespace hp {
namespace {

struct Box {
  std::vector<int64_t> offset, shape;
};

// The intersection, or nullopt if empty.
std::optional<Box> intersect(const Box& a, const Box& b) {
  Box out;
  for (size_t d = 0; d < a.offset.size(); ++d) {
    const int64_t lo = std::max(a.offset[d], b.offset[d]);
    const int64_t hi = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    if (hi <= lo) return std::nullopt;
    out.offset.push_back(lo);
    out.shape.push_back(hi - lo);
  }
  return out;
}

// `region` (global coordinates) cut out of a piece whose box is `piece`.
at::Tensor cut(const at::Tensor& local, const Box& piece, const Box& region) {
  at::Tensor t = local;
  for (size_t d = 0; d < region.offset.size(); ++d)
    t = t.narrow(d, region.offset[d] - piece.offset[d], region.shape[d]);
  return t;
}

// Coordinates of every rank of `mesh`, in row-major order (rank list order).
std::vector<std::vector<int64_t>> coordinates(const DeviceMesh& mesh) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> c(mesh.ndim(), 0);
  for (int64_t n = 0; n < mesh.size(); ++n) {
    out.push_back(c);
    for (int64_t d = mesh.ndim() - 1; d >= 0; --d) {
      if (++c[d] < mesh.shape()[d]) break;
      c[d] = 0;
    }
  }
  return out;
}

}  // namespace

at::Tensor redistribute_across_meshes(const at::Tensor& local, const DTensorSpec& src, const DeviceMesh& dst_mesh,
                                      const Placements& dst_placements, at::ScalarType dtype) {
  const comm::ProcessGroup& world = src.mesh().world();
  HP_CHECK(&world.impl() == &dst_mesh.world().impl(), "redistribute_across_meshes: ", src.mesh().str(), " and ",
           dst_mesh.str(), " were built from different world groups");
  for (const Placement& p : src.placements())
    HP_CHECK(!p.is_partial(), "redistribute_across_meshes: the source is ", to_string(src.placements()),
             "; reduce its Partial dims on the source mesh first");
  const DTensorSpec dst(dst_mesh, dst_placements, src.shape());
  const int me = world.rank();
  const bool in_src = src.mesh().get_coordinate().has_value(), in_dst = dst_mesh.get_coordinate().has_value();
  HP_CHECK(!in_src || local.defined(), "redistribute_across_meshes: world rank ", me,
           " is in the source mesh but passed no piece");
  HP_CHECK(!local.defined() || local.scalar_type() == dtype, "redistribute_across_meshes: the piece is ",
           local.scalar_type(), " but dtype says ", dtype);

  // The source copies that own data: coordinate 0 along every mesh dim that is not a shard.
  std::vector<std::pair<int, Box>> owners;
  const auto src_coords = coordinates(src.mesh());
  for (size_t k = 0; k < src_coords.size(); ++k) {
    bool owner = true;
    for (int64_t i = 0; i < src.mesh().ndim(); ++i)
      owner = owner && (src.placements()[i].is_shard() || src_coords[k][i] == 0);
    if (!owner) continue;
    auto [shape, offset] = src.local_shape_and_offset(src_coords[k]);
    owners.push_back({src.mesh().ranks()[k], Box{offset, shape}});
  }
  const auto dst_coords = coordinates(dst_mesh);
  std::vector<comm::Work> sends;
  std::vector<std::tuple<comm::Work, at::Tensor, Box>> receives;
  at::Tensor out;
  Box my_dst;
  if (in_dst) {
    auto [shape, offset] = dst.local_shape_and_offset(*dst_mesh.get_coordinate());
    my_dst = Box{offset, shape};
    out = at::empty(shape, at::TensorOptions().dtype(dtype));
  }
  for (const auto& [source, source_box] : owners) {
    for (size_t k = 0; k < dst_coords.size(); ++k) {
      const int target = dst_mesh.ranks()[k];
      if (source != me && target != me) continue;
      auto [shape, offset] = dst.local_shape_and_offset(dst_coords[k]);
      const auto region = intersect(source_box, Box{offset, shape});
      if (!region) continue;
      const int tag = source * world.size() + target;
      if (source == me && target == me) {
        cut(out, my_dst, *region).copy_(cut(local, source_box, *region));
      } else if (source == me) {
        sends.push_back(world.send_async(cut(local, source_box, *region).contiguous(), target, tag));
      } else {
        at::Tensor buffer = at::empty(region->shape, out.options());
        receives.emplace_back(world.recv_async(buffer, source, tag), buffer, *region);
      }
    }
  }
  for (auto& [work, buffer, region] : receives) {
    work.wait();
    cut(out, my_dst, region).copy_(buffer);
  }
  for (auto& work : sends) work.wait();
  return in_dst ? out : at::Tensor();
}

}  // namespace hp
