#include "train/device_memory.h"

#ifdef HP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "hp/core/error.h"

namespace hp::train::detail {

void reset_step_peak(c10::Device device, MemoryTracker& host) {
  if (device.is_cpu()) return host.reset_peak();
#ifdef HP_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#else
  HP_FAIL("no memory statistics for ", device, " in a build without HP_CUDA");
#endif
}

int64_t step_peak_bytes(c10::Device device, const MemoryTracker& host) {
  if (device.is_cpu()) return host.peak();
#ifdef HP_WITH_CUDA
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[aggregate].peak;
#else
  HP_FAIL("no memory statistics for ", device, " in a build without HP_CUDA");
#endif
}

}  // namespace hp::train::detail
