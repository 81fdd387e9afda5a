// What one step's numbers say, found together by all ranks: each rank's share of the loss and of
// the gradient norm (a rank whose gradients stand out is named in the metrics), and, when the loss
// or a gradient is not finite, where that happened.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/models/model_parts.h"
#include "hp/train/callbacks.h"

namespace hp::train::detail {

// Collective over `world`: every rank's local loss and gradient norm into `record`, and the rank
// with the largest norm (the lowest one on a tie). Returns the stop request (hp/train/stop.h) the
// ranks agree on: that of the lowest rank with one (`stop_signal`), 0 when none has.
int gather_rank_numbers(double local_loss, double local_grad_norm, int stop_signal, const comm::ProcessGroup& world,
                        StepRecord& record);

// Collective over `world`; call it when the global loss or gradient norm is not finite. The same
// sentence on every rank: the ranks whose loss is not finite and, for each rank that has one, the
// first parameter (by FQN) whose gradient is not.
std::string describe_nonfinite(const models::ModelParts& parts, double local_loss, const comm::ProcessGroup& world);

}  // namespace hp::train::detail
