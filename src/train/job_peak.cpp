#include "train/job_peak.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "hp/comm/init.h"
#include "hp/dtensor/local.h"

namespace hp::train::detail {
namespace {

// On the CPU, one product of at most 2 GFLOP: a bigger one is no faster per FLOP, and would make
// measuring a large model's vocabulary projection take minutes (and gigabytes) while the other ranks
// wait. A GPU needs far bigger products to reach its speed (2 GFLOP take microseconds there).
constexpr double kMaxProductFlops = 2e9;
constexpr double kMaxDeviceProductFlops = 2e12;

// Every 2-D parameter (out, in) as the matmul of one micro-batch's tokens with it (whole, not a
// rank's shard: a bigger matmul reaches at least the shard's speed, so the peak errs high), its
// rows capped at kMaxProductFlops.
std::vector<MatmulShape> matmul_shapes(const TrainConfig& c, const models::ModelParts& parts, double max_flops) {
  const int64_t tokens = c.train.micro_batch * c.data.seq_len / c.parallel.cp;
  std::vector<MatmulShape> shapes;
  for (const at::Tensor& p : parts.parameters()) {
    if (p.dim() != 2) continue;
    const double per_row = 2.0 * static_cast<double>(p.size(0)) * static_cast<double>(p.size(1));
    const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(tokens, static_cast<int64_t>(max_flops / per_row)));
    const MatmulShape shape{rows, p.size(1), p.size(0)};
    if (std::find(shapes.begin(), shapes.end(), shape) == shapes.end()) shapes.push_back(shape);
  }
  return shapes;
}

// A GPU's peak: the fastest of the shapes on the rank's device, each timed after a warm-up over
// enough products for about 20 ms, with the device synchronized around them (kernels run
// asynchronously: the host's clock alone would time their launches).
PeakFlops device_peak_flops(const std::vector<MatmulShape>& shapes, at::ScalarType dtype, c10::Device device) {
  PeakFlops peak;
  peak.dtype = dtype;
  using clock = std::chrono::steady_clock;
  for (const MatmulShape& shape : shapes) {
    const auto options = at::TensorOptions().dtype(dtype).device(device);
    const at::Tensor x = at::ones({shape.m, shape.k}, options), w = at::ones({shape.n, shape.k}, options);
    const auto seconds_of = [&](int reps) {
      torch::cuda::synchronize(device.index());
      const auto t0 = clock::now();
      for (int i = 0; i < reps; ++i) at::linear(x, w);
      torch::cuda::synchronize(device.index());
      return std::chrono::duration<double>(clock::now() - t0).count() / reps;
    };
    seconds_of(3);
    const int reps = std::clamp(static_cast<int>(0.02 / std::max(seconds_of(1), 1e-9)), 1, 10000);
    const double flops = 2.0 * static_cast<double>(shape.m) * static_cast<double>(shape.k) *
                         static_cast<double>(shape.n) / seconds_of(reps);
    peak.flops = std::max(peak.flops, flops);
  }
  peak.source = "measured on " + device.str() + " with the model's matmul shapes";
  return peak;
}

}  // namespace

PeakFlops job_peak_flops(const TrainConfig& c, const models::ModelParts& parts, int64_t world_size) {
  PeakFlopsOptions options;
  options.dtype = c.train.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  if (const std::optional<double> given = peak_flops_override()) {
    PeakFlops peak;
    peak.flops = *given;
    peak.dtype = options.dtype;
    peak.source = "HP_PEAK_FLOPS, for the whole job";
    return peak;
  }
  if (c.train.device == "cuda") {
    std::vector<MatmulShape> shapes = matmul_shapes(c, parts, kMaxDeviceProductFlops);
    if (shapes.empty()) shapes.push_back({8192, 8192, 8192});
    // One GPU: train.device cuda runs one rank (config validation).
    return device_peak_flops(shapes, options.dtype, local_tensor(parts.parameters().front()).device());
  }
  options.shapes = matmul_shapes(c, parts, kMaxProductFlops);
  if (options.shapes.empty()) options.shapes.push_back({1024, 1024, 1024});  // a model without matrices
  PeakFlops peak = measure_peak_flops(options);
  // Ranks per host as the launcher says (hprun, mpirun, PMI, Slurm); none (ranks as threads of
  // one process): all on this host.
  const comm::LaunchEnv launch = comm::read_launch_env();
  const int64_t per_host = launch.source == "default" ? world_size : launch.local_world_size;
  const int64_t hosts = std::max<int64_t>(1, world_size / per_host);
  if (hosts > 1) {
    peak.flops *= static_cast<double>(hosts);
    peak.source += ", times " + std::to_string(hosts) + " hosts";
  }
  return peak;
}

}  // namespace hp::train::detail
