#include "hp/core/memory_tracker.h"

#include "hp/core/libtorch_version.h"

#include <c10/core/CPUAllocator.h>

#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace hp {

struct MemoryTrackerAccess {
  static const std::shared_ptr<MemoryTracker::Counter>& counter(const MemoryTracker& t) { return t.counter_; }
  static MemoryTracker* outer(const MemoryTracker& t) { return t.outer_; }
};

namespace {

thread_local MemoryTracker* innermost = nullptr;

// One allocation charged to the counters of the trackers alive when it was made.
struct Charged {
  c10::DataPtr inner;  // owns the memory; destroying it frees through the inner allocator
  int64_t bytes;
  std::vector<std::shared_ptr<MemoryTracker::Counter>> counters;
};

// Wraps LibTorch's CPU allocator and charges allocations to the trackers of the allocating thread.
//
// A charged allocation's DataPtr has the data itself as its context, and the record is found by
// that pointer: ATen's raw_allocate (used by ops that allocate scratch memory, e.g. GELU) requires
// context == data and frees through raw_deleter(), so both paths must release the same way.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

#if HP_LIBTORCH_2
  c10::DataPtr allocate(size_t n) override { return charge(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return charge(n); }
#endif

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  static CountingAllocator& instance() {
    // Never destroyed: tensors may still be freed during static destruction at exit.
    static CountingAllocator* counting = new CountingAllocator(c10::GetCPUAllocator());
    return *counting;
  }

 private:
  c10::DataPtr charge(size_t n) const {
    // Through instance(), not `this`: c10's allocator registry hands our pointer to other threads
    // with a plain store and load, and the function-local static's guard is what orders our
    // construction before their use (ThreadSanitizer reports the read of inner_ otherwise).
    const CountingAllocator& self = instance();
    c10::DataPtr data = self.inner_->allocate(n);
    if (innermost == nullptr || n == 0) return data;
    Charged charged{std::move(data), static_cast<int64_t>(n), {}};
    for (MemoryTracker* t = innermost; t != nullptr; t = MemoryTrackerAccess::outer(*t)) {
      const auto& counter = MemoryTrackerAccess::counter(*t);
      counter->add(charged.bytes);
      charged.counters.push_back(counter);
    }
    void* ptr = charged.inner.get();
    const c10::Device device = charged.inner.device();
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      self.charged_.emplace(ptr, std::move(charged));
    }
    return {ptr, ptr, &release, device};
  }

  // Frees a pointer from allocate(): a charged one credits its counters; an uncharged one reaches
  // here only through raw_deallocate and goes back to the inner allocator's raw deleter.
  static void release(void* ptr) {
    CountingAllocator& self = instance();
    std::optional<Charged> charged;
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      auto it = self.charged_.find(ptr);
      if (it != self.charged_.end()) {
        charged.emplace(std::move(it->second));
        self.charged_.erase(it);
      }
    }
    if (!charged) {
      const c10::DeleterFnPtr inner_delete = self.inner_->raw_deleter();
      TORCH_INTERNAL_ASSERT(inner_delete != nullptr, "MemoryTracker: the CPU allocator has no raw deleter");
      inner_delete(ptr);
      return;
    }
    for (const auto& counter : charged->counters) counter->current -= charged->bytes;
  }  // `charged` frees the memory here

  c10::Allocator* inner_;
  mutable std::mutex mu_;
  mutable std::unordered_map<void*, Charged> charged_;
};

void install_counting_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::SetCPUAllocator(&CountingAllocator::instance(), /*priority=*/std::numeric_limits<uint8_t>::max());
  });
}

}  // namespace

void MemoryTracker::Counter::add(int64_t bytes) {
  const int64_t now = current += bytes;
  int64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

MemoryTracker::MemoryTracker() : counter_(std::make_shared<Counter>()), outer_(innermost) {
  install_counting_allocator();
  innermost = this;
}

MemoryTracker::~MemoryTracker() { innermost = outer_; }

int64_t MemoryTracker::current() const { return counter_->current.load(); }
int64_t MemoryTracker::peak() const { return counter_->peak.load(); }
void MemoryTracker::reset_peak() { counter_->peak.store(counter_->current.load()); }

}  // namespace hp
