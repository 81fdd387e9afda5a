// Symmetric memory: a buffer of the same size on every member of a group, which every member maps,
// so that one member reads and writes another's buffer directly (one-sided), and signals it when
// the data is there. PyTorch's SymmetricMemory for ranks that share a host's memory: processes
// started on one host (hprun, torchrun) or thread-ranks of one process.
//
//   SymmetricMemory memory = SymmetricMemory::allocate(group, 1 << 20);
//   memory.put(chunk, next);              // into member `next`'s buffer, at byte 0
//   memory.put_signal(next);              // `next` may read it now
//   memory.wait_signal(previous);         // `previous` has put its chunk into this buffer
//   at::Tensor got = memory.buffer(memory.rank(), chunk.scalar_type(), chunk.sizes());
//
// Ordering: every write a member makes before put_signal(peer, c) (put, or a write through a
// buffer() view) is visible to `peer` once its wait_signal(member, c) returns. Signals count: k
// put_signals from a member satisfy k wait_signals for it on the same channel; nothing else orders
// the buffers, so a protocol that reuses a place must let the writer know it was read (a signal
// back, or barrier()).
//
// Failures: a wait fails naming the member it waits for when that member's process exits, when the
// last handle to its SymmetricMemory is destroyed (it left), or when the timeout passes
// (hp::TimeoutError). A signal sent before its sender left still counts. After a failed wait the
// SymmetricMemory refuses every further put, get, signal, wait and barrier (a late signal would
// satisfy the wrong wait). The memory is a segment of the shared-memory transport's kind: private
// to the job (0600, an unguessable name passed through the group's store, unlinked once every
// member has mapped it), gone with the last mapping however the job ends.
//
// Use from one thread per member, as a group's collectives are.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include "hp/comm/process_group.h"

namespace hp::comm {

namespace detail {
struct SymmetricState;
struct SymmetricAccess;
}  // namespace detail

class SymmetricMemory {
 public:
  // Collective over `group`: every member calls it, in the same order as its other allocations on
  // the group, with the same `bytes` (at most 2^40) and `channels` (1 to 1024): the independent
  // signal channels each pair of members has. Otherwise, and where the members do not share a
  // host's memory, every member fails saying what each asked for. A member that never calls it
  // makes the others throw hp::TimeoutError naming it after the group's timeout (a member that
  // comes late may cost up to three timeouts: its request, the segment's name and its mapping are
  // each waited for). Refused in a fake world. A set-up call: each allocation leaves a few small
  // keys in the group's store. Two threads of one rank must not allocate on one group at once.
  static SymmetricMemory allocate(const ProcessGroup& group, int64_t bytes, int channels = 1);

  int rank() const;  // this member's rank in the group
  int size() const;
  int64_t bytes() const;  // of each member's buffer
  int channels() const;

  // `shape` values of `dtype` at byte `offset` of member `member`'s buffer, as a tensor that views
  // the shared memory (no copy; it keeps the memory mapped while it lives). Writing through it is
  // writing into that member's buffer.
  at::Tensor buffer(int member, at::ScalarType dtype, at::IntArrayRef shape, int64_t offset = 0) const;
  // Copies `source` (a CPU tensor that does not itself view this memory) into member `peer`'s
  // buffer at byte `offset`, as `source`'s dtype laid out contiguously. One-sided: `peer` does
  // nothing.
  void put(const at::Tensor& source, int peer, int64_t offset = 0) const;
  // Copies what member `peer`'s buffer holds at byte `offset` into `target` (a CPU tensor, read as
  // target's dtype and shape, contiguous).
  void get(const at::Tensor& target, int peer, int64_t offset = 0) const;

  // Tells member `peer` (it may be this member) that this member's writes so far are there to see,
  // on `channel`.
  void put_signal(int peer, int channel = 0) const;
  // Waits for the next signal from member `from` on `channel`. Throws hp::Error naming `from` when
  // it exited or left, hp::TimeoutError after `timeout` (>= 0; the group's timeout when not
  // given). After a failed wait every further put, get, signal, wait and barrier is refused.
  void wait_signal(int from, int channel = 0, std::optional<std::chrono::milliseconds> timeout = std::nullopt) const;
  // Every member's writes before the barrier are visible to every member after it. Collective; the
  // group's timeout bounds the whole barrier.
  void barrier() const;

 private:
  friend struct detail::SymmetricAccess;  // the memory a group keeps for its fused ops
  explicit SymmetricMemory(std::shared_ptr<detail::SymmetricState> state) : state_(std::move(state)) {}
  const detail::SymmetricState& state() const;
  std::shared_ptr<detail::SymmetricState> state_;
};

}  // namespace hp::comm
