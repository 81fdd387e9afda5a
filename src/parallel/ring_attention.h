// Ring attention (the context-parallel plan's kRing, and the ring half of kHybrid): an
// AttentionKernel whose keys are spread over the ranks of a group.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/nn/attention.h"

namespace hp::detail {

// forward(q, k, v, mask, scale) attends this rank's tokens' queries to the keys of every rank of
// `group` (self-attention over the group's tokens): q, k and v are this rank's tokens, at
// `key_positions[group.rank()]`; `key_positions[i]` are group rank i's (the mask's positions are not
// read, only mask.causal). K/V go round the ring one step ahead of `local`'s compute on
// them; partial results merge by log-sum-exp. backward sends K/V round again with dK/dV
// accumulators that end at their owners. Every rank must call with the same shapes. Without
// `overlap`, each exchange completes before the compute on the keys at hand (for measurements).
std::shared_ptr<const nn::AttentionKernel> ring_attention_kernel(comm::ProcessGroup group,
                                                                 std::shared_ptr<const nn::AttentionKernel> local,
                                                                 std::vector<at::Tensor> key_positions,
                                                                 bool overlap = true);

}  // namespace hp::detail
