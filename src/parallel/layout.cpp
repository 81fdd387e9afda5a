#include "parallel/layout.h"

#include <ATen/ATen.h>

#include "hp/core/chunking.h"
#include "hp/core/error.h"
#include "hp/dtensor/local.h"

namespace hp::parallel {

Placement normalized(Placement p, int64_t ndim) {
  if (p.is_shard() && p.dim() < 0) return Shard(p.dim() + ndim);
  return p;
}

Placements normalized(Placements ps, int64_t ndim) {
  for (auto& p : ps) p = normalized(p, ndim);
  return ps;
}

at::Tensor as_dtensor(const at::Tensor& x, const DeviceMesh& mesh, const Placements& layout, const std::string& where,
                      std::optional<int64_t> global_last_dim) {
  if (is_dtensor(x)) {
    HP_CHECK(DTensor(x).device_mesh() == mesh, where, ": the input is a DTensor on ", DTensor(x).device_mesh().str(),
             " but the plan's mesh is ", mesh.str());
    return x;
  }
  const Placements placements = normalized(layout, x.dim());
  const bool last_dim_sharded = mesh.ndim() == 1 && x.dim() > 0 && placements[0].is_shard(x.dim() - 1);
  if (!global_last_dim || !last_dim_sharded) return DTensor::from_local(x, mesh, placements);
  const int64_t piece = chunk_sizes(*global_last_dim, mesh.size(0))[mesh.get_local_rank(0)];
  HP_CHECK(x.size(-1) == piece, where, ": the input's last dim is ", x.size(-1), " here, but this rank's piece of ",
           *global_last_dim, " features split over ", mesh.size(0), " ranks is ", piece);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = *global_last_dim;
  return DTensor::from_local(x, mesh, placements, shape);
}

at::Tensor lay_out(const at::Tensor& x, const Placements& desired, bool use_local, comm::WireFormat wire) {
  DTensor d(x);
  const Placements want = normalized(desired, d.dim());
  // On a wire the redistribution is recorded even when nothing moves forward: the gradient's
  // reduction then happens in its backward, on the wire, not later in its own dtype.
  const bool unchanged = d.placements() == want && wire == comm::WireFormat::kNative;
  at::Tensor out = unchanged ? x : d.redistribute(d.device_mesh(), want, wire);
  return use_local ? DTensor(out).to_local() : out;
}

void distribute_parameter(nn::Module& module, const std::string& name, const DeviceMesh& mesh,
                          const Placements& placements, const std::string& fqn) {
  const at::Tensor p = module.param(name);
  HP_CHECK(!is_dtensor(p), fqn, ".", name, " is already a DTensor on ", DTensor(p).device_mesh().str(),
           "; each parameter can be placed by one plan");
  const Placements want = normalized(placements, p.dim());
  if (p.is_meta()) {
    const DTensorSpec spec(mesh, want, p.sizes().vec());
    set_placed_parameter(module, name, from_local_unchecked(at::empty(spec.local_shape(), p.options()), spec));
  } else {
    set_placed_parameter(module, name, distribute_tensor(p.detach(), mesh, want));
  }
}

void set_placed_parameter(nn::Module& module, const std::string& name, at::Tensor placed) {
  const bool requires_grad = module.param(name).requires_grad();
  placed.set_requires_grad(requires_grad);
  if (requires_grad) {
    // The gradient is laid out like the parameter. A replicated parameter used on sharded
    // activations (sequence-parallel norms) gets a Partial gradient: reduced once here, instead of
    // again by every optimizer op that reads it.
    const Placements want = DTensor(placed).placements();
    placed.register_hook([want](const at::Tensor& grad) -> at::Tensor {
      if (!is_dtensor(grad) || DTensor(grad).placements() == want) return grad;
      return DTensor(grad).redistribute(DTensor(grad).device_mesh(), want);
    });
  }
  module.set_param(name, placed);
}

void check_divisible(const std::string& what, int64_t size, int64_t ranks, const std::string& style) {
  HP_CHECK(size % ranks == 0, style, ": ", what, " has size ", size, ", which does not split evenly over ", ranks,
           " ranks; choose a tensor-parallel degree that divides it");
}

}  // namespace hp::parallel
