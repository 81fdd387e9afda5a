// What this CPU is: its model name, and which of ATen's CPU capabilities (the values
// ATEN_CPU_CAPABILITY takes) it can run. Header-only and plain C++: hp's kernels pick their loops
// by it, the matmul peak's cache is keyed by it, and hprun, which does not link LibTorch, measures
// a job under each capability (docs/performance.md#threads).
#pragma once

#include <fstream>
#include <string>
#include <vector>

namespace hp {

// "default", then "avx2" where the CPU has AVX2 and FMA, then "avx512" where it has AVX512 F, BW,
// VL and DQ (what ATen's AVX512 kernels use): portable first.
inline std::vector<std::string> runnable_cpu_capabilities() {
  __builtin_cpu_init();
  std::vector<std::string> out = {"default"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back("avx2");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    out.push_back("avx512");
  return out;
}

// /proc/cpuinfo's model name ("unknown" where it has none).
inline std::string host_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    const size_t colon = line.find(':');
    if (line.rfind("model name", 0) == 0 && colon != std::string::npos) return line.substr(colon + 1);
  }
  return "unknown";
}

}  // namespace hp
