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
// The kernel serves one forward (and its backward).
class RingFirstShift;  // start_ring_shift, below
std::shared_ptr<const nn::AttentionKernel> ring_attention_kernel(comm::ProcessGroup group,
                                                                 std::shared_ptr<const nn::AttentionKernel> local,
                                                                 std::vector<at::Tensor> key_positions,
                                                                 bool overlap = true,
                                                                 std::shared_ptr<RingFirstShift> first = nullptr);

// The forward's first exchange (this rank's K and V to the next rank), started before the call as
// soon as K and V exist (ContextParallel's async mode); given to ring_attention_kernel as `first`,
// whose forward then begins with it. Every rank starts it, or none. This rank's key positions
// must be ascending (the ring sends its keys in that order).
std::shared_ptr<RingFirstShift> start_ring_shift(const comm::ProcessGroup& group, const at::Tensor& k,
                                                 const at::Tensor& v, bool overlap = true);
// Completes a first exchange that no kernel will use (every rank does).
void finish_ring_shift(RingFirstShift& shift);

}  // namespace hp::detail
