#include "hp/core/memory_tracker.h"

#include "hp/core/memory_timeline.h"

#include "hp/core/libtorch_version.h"

#include <c10/core/CPUAllocator.h>

#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace hp {

struct MemoryTrackerAccess {
  static const std::shared_ptr<MemoryTracker::Counter>& counter(const MemoryTracker& t) { return t.counter_; }
  static MemoryTracker* outer(const MemoryTracker& t) { return t.outer_; }
  static MemoryTracker::Device device(const MemoryTracker& t) { return t.device_; }
};

namespace {

thread_local MemoryTracker* innermost = nullptr;
// The owners of a live ChargeTo (which holds them): a plain pointer, read on every allocation.
thread_local const MemoryTracker::Owners* charged_for = nullptr;

bool counts(MemoryTracker::Device tracker, MemoryTracker::Device allocation) {
  return tracker == allocation || tracker == MemoryTracker::kCpuAndMeta;
}

// One allocation charged to the counters of the trackers alive when it was made.
struct Charged {
  c10::DataPtr inner;  // owns the memory; destroying it frees through the inner allocator
  int64_t bytes;
  std::vector<std::shared_ptr<MemoryTracker::Counter>> counters;
  // The counters with a timeline, each with the allocation's id in it, and the context that finds
  // it there.
  std::vector<std::pair<std::shared_ptr<MemoryTracker::Counter>, int64_t>> records;
  const void* context = nullptr;

  // Charges `size` bytes to this thread's trackers of `device`; none when no such tracker lives.
  // `context` will be the allocation's DataPtr context (null: this record, which must not move).
  Charged(c10::DataPtr data, int64_t size, MemoryTracker::Device device, const void* context_)
      : inner(std::move(data)), bytes(size), context(context_ != nullptr ? context_ : this) {
    for (MemoryTracker* t = innermost; t != nullptr; t = MemoryTrackerAccess::outer(*t))
      if (counts(MemoryTrackerAccess::device(*t), device)) charge(MemoryTrackerAccess::counter(*t));
    if (charged_for)
      for (const auto& [counter, its_device] : *charged_for)
        if (counts(its_device, device)) charge(counter);
  }
  // Recorded before it is added, so that whatever was added is credited back. A counter with a
  // timeline moves under the timeline's lock (and is credited in its free).
  void charge(const std::shared_ptr<MemoryTracker::Counter>& counter) {
    if (counter->timeline) {
      records.emplace_back(counter, counter->timeline->allocate(bytes, context, [&] { counter->add(bytes); }));
      return;
    }
    counters.push_back(counter);
    counter->add(bytes);
  }
  ~Charged() {
    for (const auto& counter : counters) counter->current -= bytes;
    for (const auto& [counter, id] : records)
      counter->timeline->free(id, context, [&, c = counter.get()] { c->current -= bytes; });
  }
  // The moved-from record credits nothing.
  bool charged_none() const { return counters.empty() && records.empty(); }
  Charged(Charged&& other) noexcept
      : inner(std::move(other.inner)),
        bytes(std::exchange(other.bytes, 0)),
        counters(std::move(other.counters)),
        records(std::move(other.records)),
        context(other.context) {
    other.counters.clear();
    other.records.clear();
  }
  Charged& operator=(Charged&&) = delete;
};

thread_local const MemoryLabel* innermost_label = nullptr;

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
    if ((innermost == nullptr && charged_for == nullptr) || n == 0) return data;
    void* context = data.get();  // a charged CPU allocation's context is its data
    Charged charged(std::move(data), static_cast<int64_t>(n), MemoryTracker::kCpu, context);
    if (charged.charged_none()) return std::move(charged.inner);
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
  }  // `charged` credits its counters and frees the memory here

  c10::Allocator* inner_;
  mutable std::mutex mu_;
  mutable std::unordered_map<void*, Charged> charged_;
};

// Wraps the meta device's allocator, whose allocations hold no memory (a null pointer and no
// context): a charged one gets its record as the context, which the deleter credits back.
class MetaCountingAllocator final : public c10::Allocator {
 public:
  explicit MetaCountingAllocator(c10::Allocator* inner) : inner_(inner) {}

#if HP_LIBTORCH_2
  c10::DataPtr allocate(size_t n) override { return charge(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {}
#else
  c10::DataPtr allocate(size_t n) const override { return charge(n); }
#endif

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  static MetaCountingAllocator& instance() {
    static MetaCountingAllocator* counting = new MetaCountingAllocator(c10::GetAllocator(c10::DeviceType::Meta));
    return *counting;
  }

 private:
  c10::DataPtr charge(size_t n) const {
    c10::DataPtr data = instance().inner_->allocate(n);
    if ((innermost == nullptr && charged_for == nullptr) || n == 0) return data;
    // A charged meta allocation's context is its record (null: the record's own address).
    auto charged = std::make_unique<Charged>(std::move(data), static_cast<int64_t>(n), MemoryTracker::kMeta, nullptr);
    if (charged->charged_none()) return std::move(charged->inner);
    void* data_ptr = charged->inner.get();
    const c10::Device device = charged->inner.device();
    return {data_ptr, charged.release(), &release, device};
  }

  static void release(void* context) { delete static_cast<Charged*>(context); }

  c10::Allocator* inner_;
};

void install_counting_allocator(MemoryTracker::Device device) {
  static std::once_flag cpu, meta;
  if (device != MemoryTracker::kMeta) {
    std::call_once(cpu, [] {
      c10::SetCPUAllocator(&CountingAllocator::instance(), /*priority=*/std::numeric_limits<uint8_t>::max());
    });
  }
  if (device != MemoryTracker::kCpu) {
    std::call_once(meta, [] {
      c10::SetAllocator(c10::DeviceType::Meta, &MetaCountingAllocator::instance(),
                        /*priority=*/std::numeric_limits<uint8_t>::max());
    });
  }
}

}  // namespace

MemoryLabel::MemoryLabel(Kind kind, const void* module) : kind_(kind), module_(module), outer_(innermost_label) {
  innermost_label = this;
}
MemoryLabel::~MemoryLabel() { innermost_label = outer_; }
const MemoryLabel* MemoryLabel::innermost() { return innermost_label; }

std::vector<MemoryTimeline::Allocation> MemoryTimeline::allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocations_;
}

int64_t MemoryTimeline::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

int64_t MemoryTimeline::live_allocation(const void* context) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = live_.find(context);
  return it == live_.end() ? -1 : it->second;
}

int64_t MemoryTimeline::allocate(int64_t bytes, const void* context, const std::function<void()>& count) {
  const MemoryLabel* label = MemoryLabel::innermost();
  Allocation a;
  a.bytes = bytes;
  if (label) a.kind = label->kind(), a.module = label->module();
  std::lock_guard<std::mutex> lock(mu_);
  a.allocated_at = events_++;
  allocations_.push_back(a);
  const auto id = static_cast<int64_t>(allocations_.size()) - 1;
  live_[context] = id;
  count();
  return id;
}

void MemoryTimeline::free(int64_t id, const void* context, const std::function<void()>& count) {
  std::lock_guard<std::mutex> lock(mu_);
  count();
  allocations_[static_cast<size_t>(id)].freed_at = events_++;
  if (const auto it = live_.find(context); it != live_.end() && it->second == id) live_.erase(it);
}

void MemoryTracker::record(std::shared_ptr<MemoryTimeline> timeline) { counter_->timeline = std::move(timeline); }

void MemoryTracker::Counter::add(int64_t bytes) {
  const int64_t now = current += bytes;
  int64_t seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

MemoryTracker::MemoryTracker(Device device)
    : counter_(std::make_shared<Counter>()), device_(device), outer_(innermost) {
  install_counting_allocator(device);
  innermost = this;
}

MemoryTracker::~MemoryTracker() { innermost = outer_; }

std::shared_ptr<const MemoryTracker::Owners> MemoryTracker::owners_of_this_thread() {
  if (innermost == nullptr && charged_for == nullptr) return nullptr;
  auto owners = std::make_shared<Owners>();
  for (MemoryTracker* t = innermost; t != nullptr; t = t->outer_) owners->emplace_back(t->counter_, t->device_);
  if (charged_for) owners->insert(owners->end(), charged_for->begin(), charged_for->end());
  return owners;
}

MemoryTracker::ChargeTo::ChargeTo(std::shared_ptr<const Owners> owners)
    : owners_(std::move(owners)), outer_(charged_for) {
  charged_for = owners_.get();
}

MemoryTracker::ChargeTo::~ChargeTo() { charged_for = outer_; }

int64_t MemoryTracker::current() const { return counter_->current.load(); }
int64_t MemoryTracker::peak() const { return counter_->peak.load(); }
void MemoryTracker::reset_peak() { counter_->peak.store(counter_->current.load()); }

}  // namespace hp
