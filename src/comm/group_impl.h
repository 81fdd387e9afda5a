// Internal state behind hp::comm::ProcessGroup and hp::comm::Work.
#pragma once

#include <atomic>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/c10d_shim.h"
#include "comm/collective_queue.h"
#include "comm/shared_segment.h"
#include "hp/comm/init.h"
#include "hp/comm/process_group.h"

namespace hp::comm::detail {

// What every group created from one world shares: the root store, the transport device and the
// cache of groups per rank set. Owned by the world group; sub-groups only point back weakly.
struct GroupRegistry {
  std::mutex mu;
  // Which ranks share this host's memory: all of them when every rank is a thread of this process
  // or the job runs on one host; else blocks of `ranks_per_host` consecutive world ranks (the
  // numbering of hprun and torchrun).
  bool one_process = false;
  int ranks_per_host = 0;
  bool fake = false;                       // a fake world (hp::comm::fake_world): groups without peers or transport
  std::shared_ptr<FakeExchange> exchange;  // a fake world's messages to and from others (may be null)
  Transport transport = Transport::kAuto;  // options.transport with HP_COMM_TRANSPORT applied
  shim::StorePtr root_store;
  shim::DevicePtr device;
  ProcessGroupOptions options;
  int world_rank = 0;
  int world_size = 0;
  std::map<std::vector<int>, std::shared_ptr<GroupImpl>> groups;
  std::weak_ptr<GroupImpl> world;
  // Failures of this rank's collectives, sends and receives on any of these groups
  // (hp/comm/leave.h).
  std::atomic<uint64_t> failures{0};
};

// Whether the members `ranks` (world ranks) all share this host's memory, and how.
std::optional<SegmentScope> shared_scope(const GroupRegistry& registry, const std::vector<int>& ranks);

struct WorkState;
struct CollectiveSite;
class ShmChannel;
struct FusedWorkspace;

struct GroupImpl {
  // Aborted sends and receives, kept (with their buffers) for the group's lifetime: the transport
  // may still complete a message into or out of them, and must never find the memory gone.
  // Declared first, so it outlives `native`.
  std::mutex abandoned_mutex;
  std::vector<std::shared_ptr<WorkState>> abandoned;
  shim::NativeGroupPtr native;
  shim::StorePtr store;  // this group's prefix of the root store (diagnostics)
  std::string name;
  std::vector<int> ranks;  // world rank of each group rank
  int rank = 0;
  ProcessGroupOptions options;
  std::shared_ptr<GroupRegistry> owned_registry;  // set on the world group only
  std::weak_ptr<GroupRegistry> registry;
  std::atomic<uint64_t> next_seq{0};       // collectives issued so far; equal on all members
  bool fake = false;                       // of a fake world: no native group, no shared memory
  std::shared_ptr<FakeExchange> exchange;  // a fake world's (may be null)
  CollectiveQueue queue;

  // The shared-memory transport (comm/shm_channel.h) of a group whose members share this host,
  // under Transport::kShm or kAuto. It is set up when the group is created, and all members see the
  // same outcome. When they cannot share memory, kAuto leaves the group on Gloo (shm_scope empty)
  // and under kShm every collective of host tensors on the group fails, saying why.
  std::optional<SegmentScope> shm_scope;
  std::shared_ptr<ShmChannel> shm;
  std::string shm_failure;                         // why setting up failed (kShm)
  std::atomic<uint64_t> symmetric_allocations{0};  // hp::comm::SymmetricMemory's on this group, equal on all members
  // Only for a group with shm_scope, from a collective's run; throws when the channel could not be
  // set up.
  ShmChannel& shm_channel(const CollectiveSite& site);

  int size() const { return static_cast<int>(ranks.size()); }
  std::string describe() const;  // "group 'tp' (world ranks [4, 5, 6, 7])"
  // Records, for the world, that an operation of this rank on this group failed (it is about to
  // throw).
  void note_failure() const;

  // A receive buffer for composed collectives, reused from call to call so repeated collectives
  // of one size do not pay fresh pages each time. Only composed collectives use it, and the queue
  // runs those one at a time; nothing returned to a caller may alias it. Buffers above
  // kMaxCachedScratchBytes are not kept.
  // A fake world's groups keep one on the meta device, as large as the real one would be.
  at::Tensor scratch(at::IntArrayRef shape, at::ScalarType dtype, c10::Device device = c10::kCPU);
  static constexpr int64_t kMaxCachedScratchBytes = int64_t{256} << 20;
  at::Tensor scratch_storage;  // bytes

  // The symmetric memory of the fused ops (hp/comm/fused_matmul.h) and where their protocol
  // stands. Declared last: it goes first, while the group it names still exists.
  std::shared_ptr<FusedWorkspace> fused_workspace;
};

// Where a failure happened, for the error message.
struct CollectiveSite {
  GroupImpl* group;
  const char* op;
  uint64_t seq;   // collectives only: the group's sequence number
  int peer = -1;  // send/recv only: the other group rank (point-to-point is outside the sequence)
  int tag = 0;
};

// Rethrows `failure` as hp::Error / hp::TimeoutError naming the collective, the group and the
// ranks that never reached it (found by a short exchange through the group's store). `gone`: group
// ranks known to be gone (a process that exited, a member that left), who are not waited for.
[[noreturn]] void raise_collective_failure(const CollectiveSite& site, std::exception_ptr failure,
                                           const std::vector<int>& gone = {});

struct WorkState {
  virtual ~WorkState() = default;
  virtual at::Tensor wait() = 0;
  virtual bool is_completed() = 0;
  // Only a pending native send/recv can be aborted; it stays with its group (`self` is this state).
  virtual void abort(const std::shared_ptr<WorkState>& /*self*/) {}
};

// A single native c10d collective plus a local finishing step run once after it completes.
struct NativeWorkState final : WorkState {
  NativeWorkState(CollectiveSite site, std::function<at::Tensor()> finish) : site(site), finish(std::move(finish)) {}
  at::Tensor wait() override;
  bool is_completed() override;
  void abort(const std::shared_ptr<WorkState>& self) override;

  CollectiveSite site;
  std::mutex abort_mutex;  // abort() may come from the waiter's thread, another one and the queue's worker
  shim::NativeWork work;   // set by the issuer
  std::function<at::Tensor()> finish;
  std::optional<at::Tensor> result;
  std::shared_ptr<GroupImpl> keep_alive;
};

// A collective run (possibly in several steps) on the group's CollectiveQueue.
struct QueuedWorkState final : WorkState {
  explicit QueuedWorkState(std::shared_future<at::Tensor> future) : future(std::move(future)) {}
  at::Tensor wait() override { return future.get(); }
  bool is_completed() override { return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  std::shared_future<at::Tensor> future;
};

// A native collective that the group's CollectiveQueue starts, in program order, once the composed
// collectives queued before it have run; the caller waits for it. An abort before the start takes
// effect when the worker starts it (a wait() meanwhile returns once the collectives ahead end).
struct StartedLaterWorkState final : WorkState {
  StartedLaterWorkState(std::shared_future<at::Tensor> started, std::shared_ptr<NativeWorkState> native,
                        std::shared_ptr<std::atomic<bool>> abort_requested)
      : started(std::move(started)), native(std::move(native)), abort_requested(std::move(abort_requested)) {}
  at::Tensor wait() override {
    started.get();                                // rethrows a failure to start
    if (*abort_requested) native->abort(native);  // requested while the worker was starting it
    return native->wait();
  }
  bool is_completed() override {
    return started.wait_for(std::chrono::seconds(0)) == std::future_status::ready && native->is_completed();
  }
  void abort(const std::shared_ptr<WorkState>& /*self*/) override {
    *abort_requested = true;  // seen by the worker when it starts the collective
    if (started.wait_for(std::chrono::seconds(0)) == std::future_status::ready) native->abort(native);
  }
  std::shared_future<at::Tensor> started;
  std::shared_ptr<NativeWorkState> native;
  std::shared_ptr<std::atomic<bool>> abort_requested;  // shared with the worker
};

// A collective with nothing to communicate (e.g. on a group of one rank).
struct ReadyWorkState final : WorkState {
  explicit ReadyWorkState(at::Tensor t) : tensor(std::move(t)) {}
  at::Tensor wait() override { return tensor; }
  bool is_completed() override { return true; }
  at::Tensor tensor;
};

// Waits for a native collective inside a composed one, converting failures into hp errors.
void wait_native(const CollectiveSite& site, const shim::NativeWork& work);

// Creates a group from a store (used by init_process_group, the test harness and new_group). The
// world group also checks that every rank chose the same transport and host layout.
std::shared_ptr<GroupImpl> create_group(std::shared_ptr<GroupRegistry> registry, std::vector<int> ranks,
                                        std::string name, bool is_world);

}  // namespace hp::comm::detail
