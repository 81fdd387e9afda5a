// What a MemoryTracker's allocations are for, in order: a thread's label for what it is doing
// (a module's call, a collective), and a timeline of every allocation and free a tracker counts
// with its label and lifetime. A dry run (hp::train::dry_run) reads its peak's contributors from one.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
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

  // For the allocator: an allocation of `bytes` made now, found by `context` while it lives, and
  // its id; its free. `count` moves the tracker's counter under the same lock, so that the
  // timeline's order is the counter's.
  int64_t allocate(int64_t bytes, const void* context, const std::function<void()>& count);
  void free(int64_t id, const void* context, const std::function<void()>& count);

 private:
  mutable std::mutex mu_;
  std::vector<Allocation> allocations_;
  std::unordered_map<const void*, int64_t> live_;
  int64_t events_ = 0;
};

}  // namespace hp
