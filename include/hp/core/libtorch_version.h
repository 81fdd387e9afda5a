// Which LibTorch the library is built against: Debian's 1.13 (the CPU build) or 2.x (the CUDA build).
// Code that differs between them tests HP_LIBTORCH_2 here, in the few shims that hold such differences
// (docs/gpu.md lists them), so the rest of the library reads the same for both.
#pragma once

#include <torch/version.h>

#define HP_LIBTORCH_2 (TORCH_VERSION_MAJOR >= 2)
