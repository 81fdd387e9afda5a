// Expert parallelism (torchtitan's ExpertParallel) for hp::nn::MoE layers, applied from outside on a
// 1-D mesh of `ep` ranks:
//
//   hp::parallelize_module(*model, ep_mesh, {{"layers.*.moe", hp::ExpertParallel()}});
//
// Each rank holds experts/ep experts (the weights become DTensors, Shard(0)): rank r holds experts
// [r E/ep, (r+1) E/ep). The layer's rows, grouped by expert, travel dropless to the ranks holding
// their experts:
//   1. one all_to_all of the per-expert row counts (with each rank's capacity overflow, if any:
//      then every rank raises it, naming the rank), built on the counts' device; this rank's counts
//      and the received ones are then read on the host together, the layer's one host sync;
//   2. one all_to_all of the rows, with uneven splits, arriving grouped by source rank;
//   3. a local regroup to expert order (expert_major_order), the experts, and the inverse regroup;
//   4. one all_to_all back with the splits swapped.
// The dispatch and combine are differentiable (their backward is the all_to_all with the splits
// swapped), so forward runs 3 all_to_alls and backward 2. An expert receives its rows ordered by
// source rank, then by token: the rows, in the order, that one device would give it for the ranks'
// batches concatenated.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hp/nn/moe.h"
#include "hp/parallel/tensor_parallel.h"

namespace hp {

class ExpertParallel : public ParallelStyleBase {
 public:
  std::string name() const override { return "ExpertParallel"; }
  void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
  void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
};

// The dispatcher ExpertParallel installs, for a layer of `experts` experts over `group` (for tests
// and benchmarks of the dispatch itself).
std::shared_ptr<nn::TokenDispatcher> expert_parallel_dispatcher(const comm::ProcessGroup& group, int64_t experts);

// Rows received grouped by source rank (`counts[src * local_experts + e]` rows from rank src for
// local expert e, sources in rank order, each source's rows in expert order) reordered to expert
// order (each expert's rows by source rank): the index of each row of the result in the received rows.
std::vector<int64_t> expert_major_order(const std::vector<int64_t>& counts, int64_t ranks, int64_t local_experts);

}  // namespace hp
