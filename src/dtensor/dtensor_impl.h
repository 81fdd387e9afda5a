// DTensorImpl: the TensorImpl behind hp::DTensor (DESIGN 2.1).
//
// Invariants: sizes()/strides() are the global shape with contiguous strides; `local` is a plain
// (non-DTensor) tensor of spec.local_shape() on this rank; the dispatch key set is our backend key
// (PrivateUse3) plus its autograd key, so autograd sees DTensors and calls back into our kernel.
#pragma once

#include <c10/core/TensorImpl.h>

#include "hp/dtensor/spec.h"

namespace hp::detail {

constexpr c10::DispatchKey kDTensorKey = c10::DispatchKey::PrivateUse3;

class DTensorImpl final : public c10::TensorImpl {
 public:
  DTensorImpl(at::Tensor local, DTensorSpec spec);

  const at::Tensor& local() const { return local_; }
  const DTensorSpec& spec() const { return spec_; }

  // After an in-place op replaced or resized the local piece, or init_parameters allocated a
  // deferred one (the tensor keeps its identity: hooks and autograd metadata stay).
  void set_local(at::Tensor local, DTensorSpec spec);

  // Autograd saves and detaches tensors through these; without them saved DTensors come back
  // as plain TensorImpls (a lesson from the spike).
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(const c10::VariableVersion& version,
                                                              bool allow_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(c10::VariableVersion&& version,
                                                              bool allow_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;

 private:
  void refresh_metadata();
  at::Tensor local_;
  DTensorSpec spec_;
};

// nullptr when `t` is not a DTensor.
DTensorImpl* dtensor_impl(const at::Tensor& t);
// This rank's storage of `t`: a DTensor's local piece (not recorded by autograd), else `t`.
inline const at::Tensor& local_or_self(const at::Tensor& t) {
  const DTensorImpl* impl = dtensor_impl(t);
  return impl ? impl->local() : t;
}
at::Tensor make_dtensor(at::Tensor local, DTensorSpec spec);

// `dtensor` with other placements on its mesh, not recorded by autograd (the building block of
// the differentiable DTensor::redistribute and of backward functions). Returns `dtensor` itself
// when nothing changes. `wire` as in redistribute_local.
at::Tensor redistribute_untracked(const at::Tensor& dtensor, const Placements& placements,
                                  comm::WireFormat wire = comm::WireFormat::kNative);

// Registers the DTensor kernel for every ATen op (once per process, on the first DTensor).
void ensure_dtensor_kernel_registered();

}  // namespace hp::detail
