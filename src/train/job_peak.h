// The peak FLOP/s a run's MFU divides by: the host peak of the dtype its matmuls run in
// (hp/train/peak_flops.h), measured on the model's matmul shapes, times the hosts of the job.
#pragma once

#include "hp/models/model_parts.h"
#include "hp/train/config.h"
#include "hp/train/peak_flops.h"

namespace hp::train::detail {

// Rank 0 measures (the others should wait, not compute); `world_size` over the ranks per host
// (the launcher's local world size, hp::comm::read_launch_env; else all on one) counts the hosts.
PeakFlops job_peak_flops(const TrainConfig& c, const models::ModelParts& parts, int64_t world_size);

}  // namespace hp::train::detail
