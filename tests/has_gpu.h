// Whether the GPU tests can run here: the device build (HP_CUDA) and a visible GPU. They skip
// otherwise, as on the CPU machines CI runs on.
#pragma once

#include <torch/cuda.h>

namespace hp::test {

inline bool has_gpu() {
#ifdef HP_WITH_CUDA
  return torch::cuda::is_available();
#else
  return false;
#endif
}

}  // namespace hp::test
