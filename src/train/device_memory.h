// A step's peak memory where the model trains: the host's bytes (hp::MemoryTracker) on the CPU, the
// CUDA caching allocator's allocated bytes on a GPU (a build with HP_CUDA=ON).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

#include "hp/core/memory_tracker.h"

namespace hp::train::detail {

void reset_step_peak(c10::Device device, MemoryTracker& host);
int64_t step_peak_bytes(c10::Device device, const MemoryTracker& host);

}  // namespace hp::train::detail
