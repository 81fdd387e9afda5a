#include "hp/dtensor/local.h"

#include <ATen/ATen.h>

#include "dtensor/dtensor_impl.h"
#include "hp/core/error.h"

namespace hp {

const at::Tensor& local_tensor(const at::Tensor& t) { return detail::local_or_self(t); }

at::Tensor from_local_unchecked(at::Tensor local, DTensorSpec spec) {
  return detail::make_dtensor(std::move(local), std::move(spec));
}

void materialize_local(const at::Tensor& dtensor, std::optional<c10::Device> device) {
  detail::DTensorImpl* impl = detail::dtensor_impl(dtensor);
  HP_CHECK(impl != nullptr, "materialize_local: expected a DTensor, got a plain tensor");
  const at::Tensor& local = impl->local();
  if (local.is_meta())
    impl->set_local(at::empty(local.sizes(), local.options().device(device.value_or(impl->spec().mesh().device()))),
                    impl->spec());
}

}  // namespace hp
