#include "hp/dtensor/local.h"

#include <ATen/ATen.h>

#include "dtensor/dtensor_impl.h"
#include "hp/core/error.h"
#include "hp/core/storage_tier.h"

namespace hp {

const at::Tensor& local_tensor(const at::Tensor& t) { return detail::local_or_self(t); }

at::Tensor from_local_unchecked(at::Tensor local, DTensorSpec spec) {
  return detail::make_dtensor(std::move(local), std::move(spec));
}

void materialize_local(const at::Tensor& dtensor, std::optional<c10::Device> device) {
  detail::DTensorImpl* impl = detail::dtensor_impl(dtensor);
  HP_CHECK(impl != nullptr, "materialize_local: expected a DTensor, got a plain tensor");
  const at::Tensor& local = impl->local();
  if (!local.is_meta()) return;
  const at::TensorOptions options = local.options().device(device.value_or(impl->spec().mesh().device()));
  // A piece placed in a storage tier (parameter offload) before it had storage gets it there.
  StorageTier* tier = storage_tier_of(local);
  impl->set_local(tier ? empty_in_tier(*tier, local.sizes(), options) : at::empty(local.sizes(), options),
                  impl->spec());
}

}  // namespace hp
