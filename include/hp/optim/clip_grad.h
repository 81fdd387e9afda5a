// Gradient clipping over sharded gradients: one global norm across every shard of every parameter,
// whatever its mesh and placements.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "hp/comm/process_group.h"

namespace hp {

// Scales the gradients of `params` in place so that their global norm (norm_type 2 or infinity)
// is at most `max_norm`; returns the norm before clipping. DTensor gradients count each element
// once: a piece replicated over some mesh dims is counted on the ranks at coordinate 0 of those
// dims only. Plain gradients are taken as replicated on every rank of `world` (counted once).
// Collective over `world` (every rank calls it with the same parameters in the same order).
// `copies`: parameters whose gradients duplicate ones already in `params` somewhere (the second
// copy of a weight tied across pipeline stages); they are scaled alike but not counted again.
// With a deterministic `world` (ProcessGroupOptions::deterministic) the 2-norm's sum of squares is
// exact (hp/core/exact_square_sum.h): the same bits for any split of the gradients over ranks, so
// clipping does not depend on the data-parallel degree. Otherwise it is summed in double.
// `local_norm`, when given, receives the norm of the gradient pieces this rank counts (its share,
// for finding a rank whose gradients stand out).
double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm, const comm::ProcessGroup& world,
                       double norm_type = 2.0, const std::vector<at::Tensor>& copies = {},
                       double* local_norm = nullptr);

}  // namespace hp
