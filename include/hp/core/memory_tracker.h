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
#include <utility>
#include <vector>

namespace hp {

class MemoryTimeline;  // hp/core/memory_timeline.h

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
  // From now on, every allocation this tracker counts (and its free) goes into `timeline` too. Call
  // it before anything allocates for this tracker on another thread.
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
