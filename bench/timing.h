// Timing helpers shared by the benchmarks: one call's wall time and a median.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace hp::bench {

// Seconds one call of fn takes on this thread.
inline double seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace hp::bench
