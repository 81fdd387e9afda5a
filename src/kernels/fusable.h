// Which tensors hp's CPU kernels take: plain (not DTensor) strided fp32 or bf16 tensors on the
// host, or on the meta device, where a dry run of a CPU run takes the CPU run's path (and memory)
// but computes nothing; none while a ComposedKernelsScope lives.
#pragma once

#include <ATen/core/Tensor.h>

#include "hp/dtensor/dtensor.h"
#include "hp/kernels/capability.h"

namespace hp::kernels {

inline bool fusable(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return fused_kernels_enabled() && (t.device().is_cpu() || t.is_meta()) && !is_dtensor(t) &&
         t.layout() == at::kStrided && (dtype == at::kFloat || dtype == at::kBFloat16);
}

// a and b alike in dtype and device, both fusable.
inline bool fusable_pair(const at::Tensor& a, const at::Tensor& b) {
  return fusable(a) && fusable(b) && a.scalar_type() == b.scalar_type() && a.device() == b.device();
}

}  // namespace hp::kernels
