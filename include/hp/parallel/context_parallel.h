// Context parallelism: the sequence split over the ranks of a `cp` mesh dim, attention computed
// across them, applied from outside to the model's core-attention modules (hp/nn/attention.h):
//
//   hp::parallelize_module(*model, cp_mesh, {{"layers.*.attn.core", hp::ContextParallel()}});
//   at::Tensor local_tokens = hp::cp_shard(tokens, /*dim=*/1, cp_mesh.size(0), cp_rank);
//
// Every module but attention works on this rank's tokens alone; attention sees them all:
//  - kRing: K and V travel round the ring, one step ahead of the compute (batched P2P, overlapped);
//    each step's partial result is merged by log-sum-exp. W-1 exchanges forward. Backward sends
//    K/V round again (overlapped) and the dK/dV sums with them, back to their owners: 2W-1
//    exchanges. A step adds into the sum it received, so that one waits before the step computes.
//  - kAllGather: K and V gathered once per layer (backward: their gradients reduce-scattered).
//  - kUlysses: all_to_all from sequence- to head-sharded q, k, v, attention over the whole
//    sequence on heads/W heads, all_to_all back (4 all_to_alls forward, 4 backward). Query heads
//    must divide by W; fewer key/value heads than W are repeated (W a multiple of them).
//  - kHybrid: the cp ranks as (ring, ulysses) with ulysses_degree neighbouring ranks per Ulysses
//    group: Ulysses inside each group, the ring across groups.
//
// Load balancing (causal attention): with `load_balance` the sequence is cut head-tail — token
// order 0, S-1, 1, S-2, ..., split contiguously — so every rank holds as many early as late tokens
// and does the same attention work. The same cut applies to everything indexed by token (tokens,
// labels, positions): cp_shard does it. Shift labels before sharding them, and normalise the loss
// by the global token count.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/parallel/tensor_parallel.h"

namespace hp {

enum class CpMode { kRing, kAllGather, kUlysses, kHybrid };
std::string to_string(CpMode mode);
// "ring", "allgather", "ulysses", "hybrid"; anything else is an hp::Error listing them.
CpMode cp_mode_named(const std::string& name);

// The head-tail token order of a sequence of `seq` tokens (even): 0, S-1, 1, S-2, ...
// ([0, 7, 1, 6, 2, 5, 3, 4] for S 8). Rank r of W holds entries [r S/W, (r+1) S/W), ascending
// (cp_positions).
std::vector<int64_t> head_tail_order(int64_t seq);

// The global positions (int64 [seq / ranks]) that rank `rank` of `ranks` holds of a `seq`-token
// sequence, ascending: a contiguous piece, or with load_balance its piece of head_tail_order (the
// head chunk r and the tail chunk 2 ranks - 1 - r: [0, 1, 6, 7] and [2, 3, 4, 5] for S 8 on 2
// ranks). Throws hp::Error unless seq divides by ranks (by 2 x ranks with load_balance).
at::Tensor cp_positions(int64_t seq, int64_t ranks, int64_t rank, bool load_balance = true);

// This rank's shard of `x` along `dim` (a sequence of x.size(dim) tokens): the entries at
// cp_positions, in that order.
at::Tensor cp_shard(const at::Tensor& x, int64_t dim, int64_t ranks, int64_t rank, bool load_balance = true);

// Undoes cp_shard: gathers the shards of `group` along `dim` and puts the tokens back in order.
// Collective over `group`.
at::Tensor cp_unshard(const at::Tensor& local, int64_t dim, const comm::ProcessGroup& group, bool load_balance = true);

// Applies to hp::nn::CoreAttention modules on a 1-D mesh of W ranks: their inputs are then this
// rank's tokens of a sequence cut by cp_shard with the same load_balance, and positions() says
// which. Heads are checked at the first call (they are known only then under tensor parallelism).
class ContextParallel : public ParallelStyleBase {
 public:
  ContextParallel& set_mode(CpMode mode) {
    mode_ = mode;
    return *this;
  }
  ContextParallel& set_load_balance(bool load_balance) {
    load_balance_ = load_balance;
    return *this;
  }
  // kHybrid: the ranks of each Ulysses group (> 1, < W, dividing W).
  ContextParallel& set_ulysses_degree(int64_t degree) {
    ulysses_degree_ = degree;
    return *this;
  }
  // kRing / kHybrid: false waits for each K/V exchange before computing on the keys at hand, for
  // measuring what the overlap buys (bench_cp). Default true.
  ContextParallel& set_ring_overlap(bool overlap) {
    ring_overlap_ = overlap;
    return *this;
  }
  // Starts moving each call's keys and values between ranks as soon as the model has computed them
  // (nn::CoreAttention::begin), while it computes the queries: the all-gathers (kAllGather), the
  // Ulysses exchanges of K and V (kUlysses, kHybrid), or the ring's first exchange (kRing). A model
  // that does not call begin() gets the plan without it. Default false.
  ContextParallel& set_async(bool async) {
    async_ = async;
    return *this;
  }
  // Throws hp::Error unless the plan can run on `ranks` ranks with `q_heads` query and `kv_heads`
  // key/value heads per rank (after tensor parallelism): the Ulysses degree and the heads it splits.
  void check_heads(int64_t ranks, int64_t q_heads, int64_t kv_heads) const;
  std::string name() const override { return "ContextParallel(" + to_string(mode_) + ")"; }
  void check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;
  void apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const override;

 private:
  CpMode mode_ = CpMode::kRing;
  bool load_balance_ = true;
  int64_t ulysses_degree_ = 0;
  bool ring_overlap_ = true;
  bool async_ = false;
};

}  // namespace hp
