// Counting the CPU memory a thread allocates through LibTorch, for memory goals in tests and the
// per-step peak memory the trainer reports.
//
//   hp::MemoryTracker tracker;            // counts this thread's tensor allocations from now
//   at::Tensor loss = hp::cross_entropy(logits, targets);
//   tracker.peak();                      // most bytes held at once since the tracker started
//
// The first tracker installs a counting wrapper around LibTorch's CPU allocator (for the rest of
// the process; threads without a tracker pass straight through). Memory is charged to the thread
// that allocated it and credited back when it is freed, on whichever thread. Allocations made by
// other threads are not counted, unless that thread works on the allocating thread's behalf and says
// so (MemoryTracker::ChargeTo: a group's collective worker does). Trackers nest; each one counts.
//
// A dry run (hp::train::dry_run) runs a step on the meta device, where tensors have a size but no
// memory: a tracker made with MemoryTracker::kMeta counts the bytes meta tensors would take instead
// (by wrapping the meta device's allocator alike), one made with kCpuAndMeta counts both.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace hp {

// What this thread is doing, for the allocations it makes meanwhile: running a module (hp::nn's
// Module::call says which), or a collective (the comm layer's, and a group's worker thread).
// Labels nest; an allocation takes the innermost. A MemoryTimeline keeps them.
class MemoryLabel {
 public:
  enum Kind : uint8_t { kNone, kModule, kCommunication };
  explicit MemoryLabel(Kind kind, const void* module = nullptr);
  ~MemoryLabel();
  MemoryLabel(const MemoryLabel&) = delete;
  MemoryLabel& operator=(const MemoryLabel&) = delete;

  Kind kind() const { return kind_; }
  const void* module() const { return module_; }
  static const MemoryLabel* innermost();  // on this thread; null outside any

 private:
  Kind kind_;
  const void* module_;
  const MemoryLabel* outer_;
};

// Every allocation a tracker counts, in order, with its label and its lifetime in events (an
// allocation or a free is one event): what a dry run's report finds the peak's contributors in.
// MemoryTracker::record() starts one.
class MemoryTimeline {
 public:
  struct Allocation {
    int64_t bytes = 0;
    MemoryLabel::Kind kind = MemoryLabel::kNone;
    const void* module = nullptr;  // with kModule: the innermost module running
    int64_t allocated_at = 0;      // event index
    int64_t freed_at = -1;         // event index; -1 while it lives
  };

  // A copy of the allocations so far (by id, in the order they were made), and the events so far.
  std::vector<Allocation> allocations() const;
  int64_t events() const;
  // The id of the live allocation whose data pointer has `context` as its context (a tensor's
  // `storage().data_ptr().get_context()`); -1 when this timeline has none.
  int64_t live_allocation(const void* context) const;

  // For the allocator: an allocation of `bytes` made now, found by `context` while it lives; its id.
  int64_t allocate(int64_t bytes, const void* context);
  void free(int64_t id, const void* context);

 private:
  mutable std::mutex mu_;
  std::vector<Allocation> allocations_;
  std::unordered_map<const void*, int64_t> live_;
  int64_t events_ = 0;
};

class MemoryTracker {
 public:
  enum Device { kCpu, kMeta, kCpuAndMeta };  // whose allocations this tracker counts
  explicit MemoryTracker(Device device = kCpu);
  ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  int64_t current() const;  // bytes allocated since start and not yet freed
  int64_t peak() const;     // the largest `current` seen
  void reset_peak();        // peak = current
  // From now on, every allocation this tracker counts (and its free) goes into `timeline` too.
  void record(std::shared_ptr<MemoryTimeline> timeline);

  struct Counter {
    std::atomic<int64_t> current{0}, peak{0};
    std::shared_ptr<MemoryTimeline> timeline;  // set before any allocation it records
    void add(int64_t bytes);
  };

  // The trackers of this thread, for work another thread does on its behalf: null when it has none.
  using Owners = std::vector<std::pair<std::shared_ptr<Counter>, Device>>;
  static std::shared_ptr<const Owners> owners_of_this_thread();
  // While one lives on a thread, that thread's allocations are also charged to `owners` (and freeing
  // them credits those, on whichever thread).
  class ChargeTo {
   public:
    explicit ChargeTo(std::shared_ptr<const Owners> owners);
    ~ChargeTo();
    ChargeTo(const ChargeTo&) = delete;
    ChargeTo& operator=(const ChargeTo&) = delete;

   private:
    std::shared_ptr<const Owners> owners_;
    const Owners* outer_;
  };

 private:
  std::shared_ptr<Counter> counter_;
  Device device_;
  MemoryTracker* outer_;
  friend struct MemoryTrackerAccess;
};

}  // namespace hp
