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
// other threads (e.g. a collective's worker) are not counted. Trackers nest; each one counts.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace hp {

class MemoryTracker {
 public:
  MemoryTracker();
  ~MemoryTracker();
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  int64_t current() const;  // bytes allocated since start and not yet freed
  int64_t peak() const;     // the largest `current` seen
  void reset_peak();        // peak = current

  struct Counter {
    std::atomic<int64_t> current{0}, peak{0};
    void add(int64_t bytes);
  };

 private:
  std::shared_ptr<Counter> counter_;
  MemoryTracker* outer_;
  friend struct MemoryTrackerAccess;
};

}  // namespace hp
