// The one precompiled header (see HpTargets.cmake). Only stable third-party headers belong here.
//
// ATen, not <torch/torch.h>: GCC maps the whole PCH into every file that uses it, and loading the
// torch.h PCH (790 MB) cost 9 s per file, more than it saved for most of them (a file that needs
// no LibTorch at all took 9.5 s instead of 0.6 s). With ATen's PCH (409 MB, 3.8 s to load) most
// files compile 1.4-2.6x faster; a file that included <torch/torch.h> took as long as with torch.h
// precompiled (tests/dtensor: 26.5 s against 26.1 s), and 17 s once it included only the torch
// headers it uses. So files include those, never <torch/torch.h>.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>
