// The public DTensor API: construction, conversion and redistribution, each differentiable at the
// global level. Backward rules follow PyTorch: the gradient of a tensor placed Partial is taken as
// Replicate (a partial value's gradient is the same on every rank).
#include <ATen/ATen.h>

#include "dtensor/dtensor_impl.h"
#include "hp/core/chunking.h"
#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/redistribute.h"

namespace hp {
namespace {

using detail::dtensor_impl;
using detail::make_dtensor;

// A DTensor gradient in the placements its input had (Partial taken as Replicate).
at::Tensor grad_in_placements(const at::Tensor& grad, const Placements& placements,
                              comm::WireFormat wire = comm::WireFormat::kNative) {
  return detail::redistribute_untracked(grad, partial_as_replicate(placements), wire);
}

// The global shape of pieces `local` laid out by `placements`: sizes along sharded mesh dims are
// exchanged (last mesh dim first, so nested splits unwind) and checked to be torch.chunk pieces.
std::vector<int64_t> infer_global_shape(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements) {
  std::vector<int64_t> shape = local.sizes().vec();
  for (int64_t i = mesh.ndim() - 1; i >= 0; --i) {
    if (!placements[i].is_shard()) continue;
    const int64_t d = placements[i].dim() < 0 ? placements[i].dim() + local.dim() : placements[i].dim();
    HP_CHECK(d >= 0 && d < local.dim(), "from_local: ", placements[i].str(),
             " is out of range for a local tensor of shape ", local.sizes());
    at::Tensor sizes = mesh.get_group(i).all_gather(at::full({1}, shape[d], at::kLong));
    std::vector<int64_t> got(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + sizes.numel());
    int64_t total = 0;
    for (int64_t s : got) total += s;
    HP_CHECK(got == chunk_sizes(total, mesh.size(i)), "from_local: along tensor dim ", d, " the ranks of mesh dim ",
             mesh.dim_names()[i], " hold pieces of sizes ", at::IntArrayRef(got),
             ", which are not the torch.chunk pieces of ", total, " (",
             at::IntArrayRef(chunk_sizes(total, mesh.size(i))), "); pass the global shape if that is intended");
    shape[d] = total;
  }
  return shape;
}

}  // namespace

DTensor::DTensor(at::Tensor t) : at::Tensor(std::move(t)) {
  HP_CHECK(is_dtensor(*this), "DTensor: the tensor is a plain tensor; use DTensor::from_local or distribute_tensor");
}

bool is_dtensor(const at::Tensor& t) { return dtensor_impl(t) != nullptr; }

const DTensorSpec& DTensor::spec() const { return dtensor_impl(*this)->spec(); }

DTensor DTensor::from_local(const at::Tensor& local, const DeviceMesh& mesh, Placements placements,
                            std::optional<std::vector<int64_t>> shape) {
  HP_CHECK(!is_dtensor(local), "from_local: the local tensor is already a DTensor");
  HP_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), "from_local: ", placements.size(), " placements ",
           to_string(placements), " for a ", mesh.ndim(), "-D mesh");
  DTensorSpec spec(mesh, placements, shape ? *shape : infer_global_shape(local, mesh, placements));
  HP_CHECK(local.sizes() == at::IntArrayRef(spec.local_shape()), "from_local: the local tensor has shape ",
           local.sizes(), " but ", spec.str(), " puts a piece of shape ", at::IntArrayRef(spec.local_shape()),
           " on world rank ", mesh.get_rank());
  at::Tensor out = make_dtensor(local.detach(), spec);
  return DTensor(record_backward("FromLocalBackward", local, out, [placements](const at::Tensor& grad) {
    return dtensor_impl(grad_in_placements(grad, placements))->local();
  }));
}

at::Tensor DTensor::to_local() const {
  const auto* impl = dtensor_impl(*this);
  at::Tensor local = impl->local().view_as(impl->local());  // a fresh alias that can carry autograd history
  const DTensorSpec spec = impl->spec();
  return record_backward("ToLocalBackward", *this, local, [spec](const at::Tensor& grad) {
    const Placements placements = partial_as_replicate(spec.placements());
    return make_dtensor(grad.contiguous(), spec.with_placements(placements));
  });
}

DTensor DTensor::redistribute(const DeviceMesh& mesh, Placements placements, comm::WireFormat wire) const {
  const auto* impl = dtensor_impl(*this);
  HP_CHECK(mesh == impl->spec().mesh(), "redistribute: moving between meshes (", impl->spec().mesh().str(), " -> ",
           mesh.str(), ") is not supported yet; only placements on the same mesh");
  const DTensorSpec target = impl->spec().with_placements(std::move(placements));
  at::Tensor out = make_dtensor(redistribute_local(impl->local(), impl->spec(), target.placements(), wire), target);
  const Placements before = impl->spec().placements();
  return DTensor(record_backward("RedistributeBackward", *this, out, [before, wire](const at::Tensor& grad) {
    return grad_in_placements(grad, before, wire);
  }));
}

at::Tensor DTensor::full_tensor() const {
  return redistribute(device_mesh(), Placements(device_mesh().ndim(), Replicate())).to_local();
}

DTensor distribute_tensor(const at::Tensor& global, const DeviceMesh& mesh, Placements placements) {
  HP_CHECK(!is_dtensor(global), "distribute_tensor: the tensor is already a DTensor; use redistribute");
  for (const Placement& p : placements)
    HP_CHECK(!p.is_partial(), "distribute_tensor: ", p.str(), " cannot describe a full tensor; use Replicate or Shard");
  DTensorSpec spec(mesh, std::move(placements), global.sizes().vec());
  auto [shape, offset] = spec.local_shape_and_offset(*mesh.get_coordinate());
  at::Tensor piece = global.detach();
  for (size_t d = 0; d < shape.size(); ++d) piece = piece.narrow(d, offset[d], shape[d]);
  DTensor out(make_dtensor(piece.contiguous().clone(), spec));
  if (global.requires_grad()) out.requires_grad_(true);
  return out;
}

}  // namespace hp
