// In-memory checkpoints and process-level recovery (docs/resilience.md#process-level-recovery):
// every resilience.in_memory_checkpoint_interval steps each rank packs its state into one byte
// tensor in host memory and sends a copy to its buddy, the next world rank, in the background. When
// a rank's process dies and is started again, the ranks meet in a new world, agree on the newest
// step that every rank can have back (its own copy, or for the restarted rank its buddy's), and
// the buddy sends it, checked by a checksum. No disk is read.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/dcp/checkpoint.h"
#include "hp/train/memory_checkpoints.h"

namespace hp::train {

struct MemoryCheckpoints::Contents {
  // This rank's packed state (detail::pack_state) after step S, for the newest two in-memory
  // checkpoints: the copy of the newer one may not have reached the buddy when a rank dies.
  std::map<int64_t, at::Tensor> own;
  // The previous world rank's packed state, of the newest step whose copy arrived whole.
  struct Copy {
    int64_t step = 0;
    at::Tensor packed;
  };
  std::optional<Copy> buddy;
  // The exchange of the newest checkpoint while it is in flight.
  struct Exchange {
    int64_t step = 0;
    uint64_t checksum = 0;  // of the incoming copy, as its sender computed it
    at::Tensor incoming;
    std::vector<comm::Work> works;
  };
  std::optional<Exchange> exchange;
};

namespace detail {

// A rank's state as one byte tensor: the length of a JSON header (8 bytes), the header (`values`,
// and each tensor's name, dtype, shape and offset), then each tensor's bytes (a DTensor's local
// piece), so that it travels as one message.
at::Tensor pack_state(const dcp::StateDict& state);
// Writes a packed state into the tensors of `state`, which must have the packed names, dtypes and
// shapes (the same rank of the same config), and sets its values.
void unpack_state(const at::Tensor& packed, dcp::StateDict& state);
// The checksum of a packed state.
uint64_t packed_checksum(const at::Tensor& packed);

// One rank's side, over `world`.
class MemoryCheckpointing {
 public:
  MemoryCheckpointing(MemoryCheckpoints& memory, const comm::ProcessGroup& world);

  // After step `step` (or before the first step a run takes, so that some step is always held):
  // keeps `packed` as this rank's checkpoint of the step and starts the exchange
  // of copies around the ring of world ranks (this rank's to the next, the previous one's to
  // this). Returns once each knows the other's size; the copies travel in the background.
  void keep(int64_t step, at::Tensor packed);
  // Forgets what the memory holds (an earlier run's steps); an exchange in flight is given up.
  void start_over();
  // Waits for the exchange keep() started, if one is in flight. A copy whose checksum is not its
  // sender's is dropped with a warning (the buddy's previous copy stays).
  void finish_exchange();

  struct Recovered {
    int64_t step = 0;
    at::Tensor packed;  // this rank's state after that step
  };
  // Collective over the world, in a world made again after a rank's process was restarted (the old
  // world's groups dropped first: a copy in flight from it is waited for until it arrives or its
  // connection closes): the
  // ranks agree on the newest step that each can have back, a rank with nothing in memory (its
  // process is new) receives it from its buddy, which keeps its copy, and every rank returns its
  // state of that step. `damages_copy(step)`: whether this rank, sending a copy of that step,
  // damages the first one it sends (fault injection: a byte of each tensor). Throws, naming what each rank
  // holds, when no step can be had back by all.
  Recovered recover(const std::function<bool(int64_t step)>& damages_copy);

 private:
  MemoryCheckpoints::Contents& memory_;
  comm::ProcessGroup world_;
  comm::ProcessGroup ring_;      // the world's ranks in the order 1, 2, ..., 0: its own connections
  int next_ = 0, previous_ = 0;  // group ranks in ring_ of the next and the previous world rank
};

}  // namespace detail
}  // namespace hp::train
