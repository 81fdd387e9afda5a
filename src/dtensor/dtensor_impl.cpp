#include "dtensor/dtensor_impl.h"

#include <ATen/ATen.h>

#include "hp/core/error.h"
#include "hp/dtensor/redistribute.h"

namespace hp::detail {

DTensorImpl::DTensorImpl(at::Tensor local, DTensorSpec spec)
    : c10::TensorImpl(c10::DispatchKeySet(kDTensorKey), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
  set_storage_access_should_throw();  // a DTensor has no storage of its own: use to_local()
  refresh_metadata();
}

void DTensorImpl::refresh_metadata() {
  const auto& shape = spec_.shape();
  sizes_and_strides_.set_sizes(shape);
  int64_t stride = 1;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    sizes_and_strides_.stride_at_unchecked(d) = stride;
    stride *= std::max<int64_t>(shape[d], 1);
  }
  refresh_numel();
  refresh_contiguous();
}

void DTensorImpl::set_local(at::Tensor local, DTensorSpec spec) {
  device_opt_ = local.device();  // a deferred (meta) parameter gets its real storage this way
  local_ = std::move(local);
  spec_ = std::move(spec);
  refresh_metadata();
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(const c10::VariableVersion& version,
                                                                         bool allow_metadata_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local_, spec_);
  impl->set_version_counter(version);
  impl->set_allow_tensor_metadata_change(allow_metadata_change);
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(c10::VariableVersion&& version,
                                                                         bool allow_metadata_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local_, spec_);
  impl->set_version_counter(std::move(version));
  impl->set_allow_tensor_metadata_change(allow_metadata_change);
  return impl;
}

void DTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  auto* other = dynamic_cast<DTensorImpl*>(impl.get());
  HP_CHECK(other != nullptr, "DTensor: cannot copy a plain tensor's metadata into a DTensor");
  set_local(other->local_, other->spec_);
}

DTensorImpl* dtensor_impl(const at::Tensor& t) {
  if (!t.defined() || !t.key_set().has(kDTensorKey)) return nullptr;
  return static_cast<DTensorImpl*>(t.unsafeGetTensorImpl());
}

at::Tensor make_dtensor(at::Tensor local, DTensorSpec spec) {
  ensure_dtensor_kernel_registered();
  HP_CHECK(dtensor_impl(local) == nullptr, "DTensor: the local piece must be a plain tensor, not a DTensor");
  return at::detail::make_tensor<DTensorImpl>(std::move(local), std::move(spec));
}

at::Tensor redistribute_untracked(const at::Tensor& dtensor, const Placements& placements, comm::WireFormat wire) {
  const DTensorImpl* impl = dtensor_impl(dtensor);
  HP_CHECK(impl != nullptr, "redistribute: expected a DTensor, got a plain tensor");
  if (impl->spec().placements() == placements) return dtensor;
  return make_dtensor(redistribute_local(impl->local(), impl->spec(), placements, wire),
                      impl->spec().with_placements(placements));
}

}  // namespace hp::detail
