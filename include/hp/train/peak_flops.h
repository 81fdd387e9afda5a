// What MFU divides by: the most matmul FLOP/s this host's cores reach in one dtype, measured on the
// model's own matmul shapes, as the best of several trials, on every layout of ranks x threads the
// cores allow (on some CPUs fp32 matmul does not speed up with threads while bf16 does, so two
// one-thread ranks can reach twice what one two-thread rank does; a layout's rate is its ranks
// times one rank's measured alone, an upper bound where ranks share memory bandwidth). Cached per
// CPU model, LibTorch version, core count, ATEN_CPU_CAPABILITY, OMP_WAIT_POLICY, dtype and shapes:
// any of them changing measures again.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace hp::train {

// x[m, k] times a [k, n] weight.
struct MatmulShape {
  int64_t m = 0, k = 0, n = 0;
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n); }
  bool operator==(const MatmulShape& o) const { return m == o.m && k == o.k && n == o.n; }
};

struct PeakFlops {
  double flops = 0.0;  // FLOP/s of the whole host: ranks x one rank's best
  at::ScalarType dtype = at::kFloat;
  int ranks = 1, threads = 1;  // the layout that reached it
  MatmulShape shape;           // the shape that reached it
  std::string source;          // where the number comes from, for the log
};

struct PeakFlopsOptions {
  at::ScalarType dtype = at::kFloat;  // kFloat or kBFloat16
  std::vector<MatmulShape> shapes;    // at least one
  int cores = 0;                      // 0: the host's
  int trials = 5;                     // per shape and layout; the fastest counts
  double budget_seconds = 30.0;       // the measurement stops at the first layout past it
  std::filesystem::path cache;        // empty: ~/.cache/hyperparallel/peak_flops.json
  std::string cpu_model;              // empty: /proc/cpuinfo's model name
  // Seconds one matmul of `shape` takes on `threads` threads, in one trial; empty: timed with ATen.
  std::function<double(const MatmulShape& shape, at::ScalarType dtype, int threads)> time_matmul;
};

PeakFlops measure_peak_flops(const PeakFlopsOptions& options);

// HP_PEAK_FLOPS, the FLOP/s a user states for the whole job instead of a measurement; nullopt
// when unset. Throws hp::Error unless it is a finite positive number.
std::optional<double> peak_flops_override();

// "bf16" for kBFloat16, "fp32" for kFloat.
std::string dtype_name(at::ScalarType dtype);

}  // namespace hp::train
