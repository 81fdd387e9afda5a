// The plan hp-train --dry-run prints (rank 0): dims and mesh, the model, the batch split, and per
// rank its parameters and its training memory (a dry run's peak where it covers the layout).
#pragma once

#include "hp/comm/process_group.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/model_parts.h"
#include "hp/train/config.h"
#include "hp/train/routing_model.h"

namespace hp::train::detail {

// Collective over `world` (gathers every rank's numbers); rank 0 prints. The dry run's routers
// choose by `routing`. `memory_limit_gib` > 0: says which ranks fit in it, with `allocator_slack`
// (TrainOptions).
void print_plan(const TrainConfig& config, const comm::ProcessGroup& world, const DeviceMesh& mesh,
                const models::ModelParts& parts, const RoutingModel& routing, double memory_limit_gib = 0.0,
                double allocator_slack = 0.1);

}  // namespace hp::train::detail
