// hp::comm::ProcessGroup: the narrow facade over c10d process groups (Gloo here; NCCL where
// LibTorch has CUDA) that everything else in HyperParallel talks to.
//
// Contract (as in c10d): every member of a group must issue the same collectives on it in the same
// order. Ranks in this API are *group* ranks (0..size()-1); ranks() maps them to world ranks.
// Every collective has an async form returning a Work and a blocking form (= async + wait).
// Failures (a dead peer, a peer that never arrives, a timeout) surface from wait() as hp::Error /
// hp::TimeoutError naming the collective, the group and the ranks missing; never as a hang.
//
// A ProcessGroup is a cheap handle (shared ownership); copies refer to the same group.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "hp/comm/store.h"
#include "hp/comm/types.h"

namespace hp::comm {

namespace detail {
struct GroupImpl;
struct WorkState;
}  // namespace detail

// The handle of one issued collective.
class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

  // Blocks until the collective completes and returns its result (for in-place collectives the
  // tensor that was passed in). Throws hp::Error / hp::TimeoutError on failure.
  at::Tensor wait();
  bool is_completed() const;
  // Stops a wait() on a pending send or receive (from any thread): that wait() throws hp::Error
  // saying it was aborted. The message itself is not withdrawn, so the peer pair is out of step
  // afterwards; this is for giving up on a failed job. Collectives ignore it.
  void abort();

 private:
  std::shared_ptr<detail::WorkState> state_;
};

// One send or receive of a batch (ProcessGroup::batch_isend_irecv).
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind;
  at::Tensor tensor;  // sent from, or received into (the sender's shape and dtype)
  int peer;           // group rank
  int tag = 0;
  static P2POp send(at::Tensor tensor, int peer, int tag = 0) { return {Kind::kSend, std::move(tensor), peer, tag}; }
  static P2POp recv(at::Tensor tensor, int peer, int tag = 0) { return {Kind::kRecv, std::move(tensor), peer, tag}; }
};

class ProcessGroup {
 public:
  ProcessGroup() = default;
  explicit ProcessGroup(std::shared_ptr<detail::GroupImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  int rank() const;                       // this member's group rank
  int size() const;                       // number of members
  const std::string& name() const;        // e.g. "world", "tp", "ranks[0,2]"
  const std::vector<int>& ranks() const;  // world rank of each group rank
  const ProcessGroupOptions& options() const;

  // In place: every rank ends with op(tensor of rank 0, ..., tensor of rank n-1).
  Work all_reduce_async(const at::Tensor& tensor, AllReduceOptions opts = {}) const;
  at::Tensor all_reduce(const at::Tensor& tensor, AllReduceOptions opts = {}) const;

  // Returns the concatenation of every rank's input along opts.dim.
  Work all_gather_async(const at::Tensor& input, AllGatherOptions opts = {}) const;
  at::Tensor all_gather(const at::Tensor& input, AllGatherOptions opts = {}) const;
  // The same into a preallocated `output` of the gathered shape (returned). An even dim-0 gather
  // into a contiguous output receives in place, with no copy.
  Work all_gather_into_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                    AllGatherOptions opts = {}) const;
  at::Tensor all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input,
                                    AllGatherOptions opts = {}) const;

  // Returns this rank's piece (along opts.dim) of the reduction of every rank's input.
  Work reduce_scatter_async(const at::Tensor& input, ReduceScatterOptions opts = {}) const;
  at::Tensor reduce_scatter(const at::Tensor& input, ReduceScatterOptions opts = {}) const;
  // The same into a preallocated `output` of this rank's piece's shape (returned).
  Work reduce_scatter_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                   ReduceScatterOptions opts = {}) const;
  at::Tensor reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                                   ReduceScatterOptions opts = {}) const;

  // Returns the pieces received from every rank, concatenated along dim 0.
  Work all_to_all_async(const at::Tensor& input, AllToAllOptions opts = {}) const;
  at::Tensor all_to_all(const at::Tensor& input, AllToAllOptions opts = {}) const;

  // In place: every rank ends with root's tensor.
  Work broadcast_async(const at::Tensor& tensor, int root) const;
  at::Tensor broadcast(const at::Tensor& tensor, int root) const;

  // Point to point between group ranks. `tag` lets several messages between one pair be matched.
  // The receiving tensor must have the sender's shape and dtype.
  Work send_async(const at::Tensor& tensor, int peer, int tag = 0) const;
  void send(const at::Tensor& tensor, int peer, int tag = 0) const;
  Work recv_async(const at::Tensor& tensor, int peer, int tag = 0) const;
  at::Tensor recv(const at::Tensor& tensor, int peer, int tag = 0) const;

  // Posts every operation of `ops`, in order, and returns one Work per operation, as
  // torch.distributed.batch_isend_irecv does. All are checked before any is posted, so a bad
  // operation leaves nothing half-posted. Ranks may send to and receive from each other within
  // one batch in any order: every operation is posted before anyone waits.
  std::vector<Work> batch_isend_irecv(const std::vector<P2POp>& ops) const;

  Work barrier_async() const;
  void barrier() const;

  // Creates (or returns the cached) group of the given world ranks. Only members call it; all
  // members must create groups in the same order. Groups are cached per rank set, so a mesh and
  // its sub-meshes share one group per distinct set of ranks.
  ProcessGroup new_group(std::vector<int> world_ranks, const std::string& name = "") const;

  // This group's share of the rendezvous store (hp/comm/store.h).
  GroupStore store() const;

  // The group's internals: their type is known only inside the comm layer (other layers can
  // compare two groups' addresses, nothing else).
  detail::GroupImpl& impl() const;

 private:
  std::shared_ptr<detail::GroupImpl> impl_;
};

}  // namespace hp::comm
