// custom_shard and DFunction (see hp/dtensor/custom.h).
#include "hp/dtensor/custom.h"

#include <ATen/ATen.h>

#include "dtensor/dtensor_impl.h"
#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"
#include "hp/dtensor/redistribute.h"

namespace hp {
namespace {

std::vector<DTensor> to_placements(const char* what, const DeviceMesh& mesh, const std::vector<Placements>& placements,
                                   const std::vector<at::Tensor>& inputs) {
  HP_CHECK(placements.size() == inputs.size(), what, ": ", placements.size(), " input placements for ", inputs.size(),
           " inputs");
  std::vector<DTensor> out;
  for (size_t k = 0; k < inputs.size(); ++k) {
    HP_CHECK(is_dtensor(inputs[k]), what, ": input ", k, " is a plain tensor; pass DTensors");
    DTensor d(inputs[k]);
    HP_CHECK(d.device_mesh() == mesh, what, ": input ", k, " lives on ", d.device_mesh().str(), ", not on ",
             mesh.str());
    out.push_back(d.placements() == placements[k] ? d : d.redistribute(mesh, placements[k]));
  }
  return out;
}

}  // namespace

at::Tensor custom_shard(const LocalFn& fn, const DeviceMesh& mesh, Placements out_placements,
                        std::vector<Placements> in_placements, const std::vector<at::Tensor>& inputs,
                        std::optional<std::vector<int64_t>> out_shape) {
  std::vector<at::Tensor> locals;
  for (const DTensor& d : to_placements("custom_shard", mesh, in_placements, inputs)) locals.push_back(d.to_local());
  return DTensor::from_local(fn(locals), mesh, std::move(out_placements), std::move(out_shape));
}

at::Tensor DFunction::apply(const std::vector<at::Tensor>& inputs,
                            std::optional<std::vector<int64_t>> out_shape) const {
  HP_CHECK(forward && backward, name, ": needs both a local forward and a local backward");
  HP_CHECK(!inputs.empty(), name, ": needs at least one DTensor input");
  const DeviceMesh mesh = DTensor(inputs.at(0)).device_mesh();
  const std::vector<DTensor> placed = to_placements(name.c_str(), mesh, input_placements, inputs);
  std::vector<at::Tensor> locals;
  for (const DTensor& d : placed) locals.push_back(detail::dtensor_impl(d)->local());
  at::Tensor local_out;
  {
    at::NoGradGuard no_grad;  // the local forward is not recorded: `backward` is its derivative
    local_out = forward(locals);
  }
  const DTensorSpec out_spec = out_shape ? DTensorSpec(mesh, output_placements, *out_shape)
                                         : DTensor::from_local(local_out, mesh, output_placements).spec();
  at::Tensor out = detail::make_dtensor(local_out, out_spec);
  std::vector<at::Tensor> recorded(placed.begin(), placed.end());
  const auto backward_fn = backward;
  const std::vector<Placements> in_specs = input_placements;
  const std::string fn_name = name;
  const Placements grad_placements = partial_as_replicate(output_placements);
  return record_backward(name, recorded, out, [=](const at::Tensor& grad) {
    const at::Tensor g = detail::redistribute_untracked(grad, grad_placements);
    std::vector<at::Tensor> local_grads = backward_fn(detail::dtensor_impl(g)->local(), locals);
    HP_CHECK(local_grads.size() == in_specs.size(), fn_name, ": backward returned ", local_grads.size(),
             " gradients for ", in_specs.size(), " inputs");
    std::vector<at::Tensor> grads;
    for (size_t k = 0; k < local_grads.size(); ++k) {
      if (!local_grads[k].defined()) {
        grads.emplace_back();
        continue;
      }
      const DTensorSpec& in = detail::dtensor_impl(recorded[k])->spec();
      grads.push_back(detail::make_dtensor(local_grads[k], in.with_placements(partial_as_replicate(in_specs[k]))));
    }
    return grads;
  });
}

}  // namespace hp
