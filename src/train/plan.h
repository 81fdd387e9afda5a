// The plan hp-train --dry-run prints (rank 0): dims and mesh, the model, the batch split, and per
// rank its parameters and its training memory (a dry run's peak where it covers the layout).
#pragma once

#include "hp/comm/process_group.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/model_parts.h"
#include "hp/train/config.h"
#include "hp/train/trainer.h"

namespace hp::train::detail {

// Collective over `world` (gathers every rank's numbers); rank 0 prints. Each rank's memory is its
// dry run's peak, or an estimate on a device the dry run does not cover; a dry run that fails on
// the CPU fails every rank, with the error on the failed rank. `options`: the dry run's routing
// model, the memory limit and allocator slack, and where each rank writes its report
// (TrainOptions).
void print_plan(const TrainConfig& config, const comm::ProcessGroup& world, const DeviceMesh& mesh,
                const models::ModelParts& parts, const TrainOptions& options);

}  // namespace hp::train::detail
