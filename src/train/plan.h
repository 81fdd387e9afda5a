// The plan hp-train --dry-run prints (rank 0): dims and mesh, the model, the batch split, and per
// rank its parameters and its training memory (a dry run's peak where it covers the layout).
#pragma once

#include "hp/comm/process_group.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/model_parts.h"
#include "hp/train/config.h"
#include "hp/train/dry_run.h"

namespace hp::train::detail {

// Collective over `world` (gathers every rank's numbers); rank 0 prints. Each rank's memory is its
// dry run's peak (with `dry`'s options), or an estimate on a device the dry run does not cover; a
// dry run that fails on the CPU fails every rank, with the error on the failed rank. `memory_limit_gib`
// > 0: says which ranks fit in it, with `allocator_slack` (TrainOptions).
void print_plan(const TrainConfig& config, const comm::ProcessGroup& world, const DeviceMesh& mesh,
                const models::ModelParts& parts, const DryRunOptions& dry, double memory_limit_gib = 0.0,
                double allocator_slack = 0.1);

}  // namespace hp::train::detail
