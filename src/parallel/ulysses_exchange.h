// Ulysses's exchange (the context-parallel plan's kUlysses, and the Ulysses half of kHybrid):
// all_to_alls between a group's sequence-sharded and head-sharded layouts, with the gathered
// sequence in ascending position order.
//
// Each conversion is one all_to_all on the group (its backward another), blocking but for
// start_sequence_to_heads; every member converts the same tensors' shapes in the same order.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "hp/comm/functional.h"
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
  // sequence_to_heads, issued without waiting: wait() returns its result.
  comm::functional::PendingCollective start_sequence_to_heads(const at::Tensor& x) const;

 private:
  // Tokens [offset, offset + length) of `rank` lie at [at, at + length) of the gathered sequence.
  struct Run {
    int64_t rank, offset, at, length;
  };
  // sequence_to_heads, not recorded: the all_to_all's input, and its result put in order.
  at::Tensor pieces_to_send(const at::Tensor& x) const;
  at::Tensor arrange(const at::Tensor& received, const at::Tensor& x) const;
  at::Tensor gather(const at::Tensor& x) const;
  at::Tensor scatter(const at::Tensor& x) const;  // heads_to_sequence, not recorded
  // `gathered` (gather(x)) made to depend on x.
  at::Tensor record_sequence_to_heads(const at::Tensor& x, at::Tensor gathered) const;

  comm::ProcessGroup group_;
  int64_t local_ = 0;  // tokens per rank
  at::Tensor sorted_;
  std::vector<Run> runs_;
};

}  // namespace hp::detail
