// Where the pipeline's positions (the schedule's "ranks") run, and how a stage's activations and
// gradients cross from one position's ranks to the next's (MPMD stage meshes).
//
// A position may run on several group ranks, e.g. a tensor-parallel mesh: each of its ranks runs
// the position's program on its own share of the stages. Between positions, tensors travel whole:
// a stage whose boundary tensor is sharded over its ranks (sequence parallel) gathers it first,
// and the other side takes its own piece. Receiving rank j of a position is fed by sending rank
// j % n of the other position (n its size), so every rank gets each message exactly once.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "hp/comm/process_group.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

class StagePlacement {
 public:
  // `position_ranks[p]`: the group ranks running position p; empty = group rank p runs position p.
  StagePlacement(const Schedule& schedule, std::vector<std::vector<int>> position_ranks,
                 const comm::ProcessGroup& group);

  int position() const { return position_; }  // this rank's position
  int position_of_stage(int stage) const { return stage_position_[stage]; }
  bool hosts(int stage) const { return stage_position_[stage] == position_; }
  int first_rank_of_stage(int stage) const { return positions_[stage_position_[stage]].front(); }
  const std::vector<int>& ranks_of_position(int position) const { return positions_[position]; }
  int index_in_position() const { return index_; }
  // Whether this rank reports its position's values (the loss) for the position: its first rank.
  bool is_position_leader() const { return index_ == 0; }

  // The rank of position `from` that sends to this rank, and the ranks of `to` this rank sends to.
  int source(int from) const;
  std::vector<int> targets(int to) const;

  // The whole boundary tensor from this rank's piece (sharded on `shard_dim` over the position's
  // ranks; -1: every rank holds it whole), and this rank's piece of a whole one.
  at::Tensor whole(const at::Tensor& piece, int64_t shard_dim) const;
  at::Tensor piece(const at::Tensor& whole, int64_t shard_dim) const;

 private:
  std::vector<std::vector<int>> positions_;
  std::vector<int> stage_position_;
  int position_ = -1, index_ = -1;
  comm::ProcessGroup position_group_;  // this position's ranks, when more than one
};

}  // namespace hp::pp
