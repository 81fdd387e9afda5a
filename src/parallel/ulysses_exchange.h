// Ulysses's exchange (the context-parallel plan's kUlysses, and the Ulysses half of kHybrid):
// all_to_alls between a group's sequence-sharded and head-sharded layouts, with the gathered
// sequence in ascending position order.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "hp/comm/process_group.h"

namespace hp::detail {

class UlyssesExchange {
 public:
  // `rank_positions` (int64 [n * s] on the host): the global positions of the s tokens of each of
  // `group`'s n ranks, rank i's at [i * s, (i + 1) * s), each rank's ascending.
  UlyssesExchange(comm::ProcessGroup group, const at::Tensor& rank_positions);

  // The positions of the gathered sequence: the group's, ascending. So the attention kernel takes
  // q, k, v, the output and its gradient as they lie instead of copying them to sort them.
  const at::Tensor& positions() const { return sorted_; }

  // Sequence-sharded [b, h, s, d] on each rank -> head-sharded [b, h / n, n s, d], the sequence in
  // positions()' order; differentiable (the backward is heads_to_sequence), and the inverse.
  at::Tensor sequence_to_heads(const at::Tensor& x) const;
  at::Tensor heads_to_sequence(const at::Tensor& x) const;

 private:
  // Tokens [offset, offset + length) of `rank` lie at [at, at + length) of the gathered sequence.
  struct Run {
    int64_t rank, offset, at, length;
  };
  at::Tensor gather(const at::Tensor& x) const;   // sequence_to_heads, not recorded
  at::Tensor scatter(const at::Tensor& x) const;  // heads_to_sequence, not recorded

  comm::ProcessGroup group_;
  int64_t local_ = 0;  // tokens per rank
  at::Tensor sorted_;
  std::vector<Run> runs_;
};

}  // namespace hp::detail
