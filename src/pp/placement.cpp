#include "pp/placement.h"

#include <ATen/ATen.h>

#include <set>

#include "hp/core/chunking.h"
#include "hp/core/error.h"

namespace hp::pp {

StagePlacement::StagePlacement(const Schedule& schedule, std::vector<std::vector<int>> position_ranks,
                               const comm::ProcessGroup& group)
    : positions_(std::move(position_ranks)), stage_position_(schedule.stage_rank) {
  if (positions_.empty()) {
    HP_CHECK(group.size() == schedule.ranks, "PipelineExecutor: the schedule has ", schedule.ranks,
             " ranks but the group has ", group.size());
    for (int r = 0; r < schedule.ranks; ++r) positions_.push_back({r});
  }
  HP_CHECK(static_cast<int>(positions_.size()) == schedule.ranks, "PipelineExecutor: the schedule has ", schedule.ranks,
           " ranks (positions) but ", positions_.size(), " position rank lists were given");
  std::set<int> seen;
  for (size_t p = 0; p < positions_.size(); ++p) {
    HP_CHECK(!positions_[p].empty(), "PipelineExecutor: position ", p, " has no ranks");
    for (size_t i = 0; i < positions_[p].size(); ++i) {
      const int r = positions_[p][i];
      HP_CHECK(r >= 0 && r < group.size(), "PipelineExecutor: position ", p, " names rank ", r,
               ", which is not in the pipeline group of ", group.size(), " ranks");
      HP_CHECK(seen.insert(r).second, "PipelineExecutor: rank ", r, " runs more than one position");
      if (r == group.rank()) position_ = static_cast<int>(p), index_ = static_cast<int>(i);
    }
  }
  HP_CHECK(static_cast<int>(seen.size()) == group.size(), "PipelineExecutor: the positions name ", seen.size(),
           " ranks but the pipeline group has ", group.size(), "; every rank must run a position");
  const std::vector<int>& mine = positions_[position_];
  if (mine.size() > 1) {
    std::vector<int> world_ranks;
    for (int r : mine) world_ranks.push_back(group.ranks()[r]);
    position_group_ = group.new_group(world_ranks, "pp_position" + std::to_string(position_));
  }
}

int StagePlacement::source(int from) const {
  const std::vector<int>& senders = positions_[from];
  return senders[index_ % senders.size()];
}

std::vector<int> StagePlacement::targets(int to) const {
  const int senders = static_cast<int>(positions_[position_].size());
  std::vector<int> out;
  for (size_t j = 0; j < positions_[to].size(); ++j)
    if (static_cast<int>(j) % senders == index_) out.push_back(positions_[to][j]);
  return out;
}

at::Tensor StagePlacement::whole(const at::Tensor& piece, int64_t shard_dim) const {
  if (shard_dim < 0 || !position_group_.defined()) return piece.contiguous();
  // Pieces follow torch.chunk, so they differ in size when the dim does not divide evenly (a
  // sequence of odd length during inference); the ranks tell each other theirs first.
  const at::Tensor sizes = position_group_.all_gather(at::full({1}, piece.size(shard_dim), at::kLong));
  comm::AllGatherOptions options;
  options.dim = shard_dim;
  for (int64_t i = 0; i < sizes.numel(); ++i) options.sizes.push_back(sizes[i].item<int64_t>());
  return position_group_.all_gather(piece.contiguous(), options);
}

at::Tensor StagePlacement::piece(const at::Tensor& whole, int64_t shard_dim) const {
  if (shard_dim < 0 || !position_group_.defined()) return whole;
  const int64_t n = position_group_.size(), length = whole.size(shard_dim);
  return whole.narrow(shard_dim, chunk_offset(length, n, index_), chunk_sizes(length, n)[index_]).contiguous();
}

}  // namespace hp::pp
