// Optimizer state lives where its parameter lives: in the compute allocator, or in the storage
// tier of an offloaded parameter (hp/parallel/offload.h). A step reads what it will touch ahead
// (prefetch_storage) and settles it once written (settle_storage).
#pragma once

#include <ATen/ATen.h>

#include "hp/core/storage_tier.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"

namespace hp::detail {

// Zeros shaped like the parameter `p`, in its tier when its (local) storage is in one.
inline at::Tensor zero_state_like(const at::Tensor& p) {
  const at::Tensor& local = local_tensor(p);
  if (!storage_tier_of(local)) return at::zeros_like(p, at::MemoryFormat::Preserve);
  at::Tensor zeros = zeros_like_in_its_tier(local);
  return is_dtensor(p) ? from_local_unchecked(std::move(zeros), DTensor(p).spec()) : zeros;
}

}  // namespace hp::detail
