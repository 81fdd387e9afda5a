#include "train/job_peak.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "hp/comm/init.h"

namespace hp::train::detail {
namespace {

// One product of at most 2 GFLOP: a bigger one is no faster per FLOP, and would make measuring a
// large model's vocabulary projection take minutes (and gigabytes) while the other ranks wait.
constexpr double kMaxProductFlops = 2e9;

// Every 2-D parameter (out, in) as the matmul of one micro-batch's tokens with it (whole, not a
// rank's shard: a bigger matmul reaches at least the shard's speed, so the peak errs high), its
// rows capped at kMaxProductFlops.
std::vector<MatmulShape> matmul_shapes(const TrainConfig& c, const models::ModelParts& parts) {
  const int64_t tokens = c.train.micro_batch * c.data.seq_len / c.parallel.cp;
  std::vector<MatmulShape> shapes;
  for (const at::Tensor& p : parts.parameters()) {
    if (p.dim() != 2) continue;
    const double per_row = 2.0 * static_cast<double>(p.size(0)) * static_cast<double>(p.size(1));
    const int64_t rows =
        std::max<int64_t>(1, std::min<int64_t>(tokens, static_cast<int64_t>(kMaxProductFlops / per_row)));
    const MatmulShape shape{rows, p.size(1), p.size(0)};
    if (std::find(shapes.begin(), shapes.end(), shape) == shapes.end()) shapes.push_back(shape);
  }
  return shapes;
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
  options.shapes = matmul_shapes(c, parts);
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
