#include "hp/core/memory_tracker.h"

#include <c10/core/CPUAllocator.h>

#include <mutex>
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
  c10::DataPtr inner;
  int64_t bytes;
  std::vector<std::shared_ptr<MemoryTracker::Counter>> counters;

  static void release(void* ctx) {
    auto* c = static_cast<Charged*>(ctx);
    for (const auto& counter : c->counters) counter->current -= c->bytes;
    delete c;  // frees the memory through the inner allocator's deleter
  }
};

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) const override {
    c10::DataPtr data = inner_->allocate(n);
    if (innermost == nullptr || n == 0) return data;
    auto* charged = new Charged{std::move(data), static_cast<int64_t>(n), {}};
    for (MemoryTracker* t = innermost; t != nullptr; t = MemoryTrackerAccess::outer(*t)) {
      const auto& counter = MemoryTrackerAccess::counter(*t);
      counter->add(charged->bytes);
      charged->counters.push_back(counter);
    }
    void* ptr = charged->inner.get();
    const c10::Device device = charged->inner.device();
    return {ptr, charged, &Charged::release, device};
  }

 private:
  c10::Allocator* inner_;
};

void install_counting_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator counting(c10::GetCPUAllocator());  // lives for the process
    c10::SetCPUAllocator(&counting, /*priority=*/std::numeric_limits<uint8_t>::max());
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
