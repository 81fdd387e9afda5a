// Ring attention (the context-parallel plan's kRing, and the ring half of kHybrid): an
// AttentionKernel whose keys are spread over the ranks of a group.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/nn/attention.h"

namespace hp::detail {

// forward(q, k, v, mask, scale) attends this rank's queries (at mask.q_positions) to the keys of
// every rank of `group`: k and v are this rank's, `key_positions[i]` are group rank i's positions
// (mask.k_positions is not read). K/V go round the ring one step ahead of `local`'s compute on
// them; partial results merge by log-sum-exp. backward sends K/V round again with dK/dV
// accumulators that end at their owners. Every rank must call with the same shapes.
std::shared_ptr<const nn::AttentionKernel> ring_attention_kernel(comm::ProcessGroup group,
                                                                 std::shared_ptr<const nn::AttentionKernel> local,
                                                                 std::vector<at::Tensor> key_positions);

}  // namespace hp::detail
