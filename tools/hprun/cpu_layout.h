// hprun --cpu-layout auto: how many threads each rank runs and which of ATen's CPU capabilities
// (ATEN_CPU_CAPABILITY) it uses, chosen by timing the job itself under each candidate, and
// remembered per host and job (docs/performance.md#threads). Plain C++: hprun links no LibTorch.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace hp::hprun {

struct CpuLayout {
  int threads = 1;           // per rank: OMP_NUM_THREADS and OPENBLAS_NUM_THREADS
  std::string capability;    // ATEN_CPU_CAPABILITY
  std::string text() const;  // "2 threads per rank, avx512"
};

// For `ranks` ranks on `cores` cores: threads per rank cores / ranks (at least 1) and every power
// of two below it, each with every capability this CPU runs; a value the environment already sets
// (OMP_NUM_THREADS, ATEN_CPU_CAPABILITY) is the only one tried for its part.
std::vector<CpuLayout> layout_candidates(int cores, int ranks);

// What a measurement depends on: the CPU model, its cores, the ranks, the settings the environment
// fixes, and the command line with the contents of every file it names (a config).
std::string layout_cache_key(int cores, int ranks, const std::vector<std::string>& command);

// ~/.cache/hyperparallel/cpu_layout.json.
std::filesystem::path layout_cache_path();

struct CachedLayout {
  CpuLayout layout;
  double throughput = 0.0;
  std::string measured;  // when, "2026-12-06 02:50 UTC"
};
std::optional<CachedLayout> cached_layout(const std::filesystem::path& cache, const std::string& key);
// Best effort: an unwritable cache costs a measurement next time, nothing else.
void cache_layout(const std::filesystem::path& cache, const std::string& key, const CpuLayout& layout,
                  double throughput);

}  // namespace hp::hprun
