#include "hp/parallel/activation_swap.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <utility>

#include "hp/core/error.h"
#include "parallel/swap_region.h"

namespace hp {
namespace detail {

size_t SwapRegion::add(const at::Tensor& output) {
  // The tiers copy host memory (an accelerator's copies would need its streams).
  HP_CHECK(output.is_cpu() || output.is_meta(), "activation swap: ", output.device(),
           " tensors are not supported (the tiers copy host memory)");
  Slot slot;
  slot.tensor = output;
  slot.shape = output.sizes().vec();
  slot.dtype = output.scalar_type();
  slot.device = output.device();
  slot.bytes = static_cast<int64_t>(output.numel()) * static_cast<int64_t>(output.element_size());
  slots_.push_back(std::move(slot));
  return slots_.size() - 1;
}

std::pair<int64_t, int64_t> SwapRegion::pin_aliases_of(const at::Tensor& t) {
  int64_t count = 0, bytes = 0;
  for (Slot& slot : slots_)
    if (slot.tensor.defined() && slot.tensor.is_alias_of(t)) {
      slot.pinned = true;
      ++count;
      bytes += slot.bytes;
    }
  return {count, bytes};
}

void SwapRegion::drop(size_t slot) {
  slots_.at(slot).tensor = at::Tensor();
  slots_.at(slot).pinned = true;
}

at::Tensor SwapRegion::get(size_t slot) const {
  const Slot& s = slots_.at(slot);
  HP_CHECK(s.state == State::kResident || s.state == State::kReloaded,
           "activation swap: a swapped tensor was asked for before its reload");
  return s.tensor;
}

}  // namespace detail

using detail::SwapRegion;
using State = SwapRegion::State;

SwapManager::Impl::Impl(SwapOptions o) : options(std::move(o)) {
  HP_CHECK(options.prefetch >= 0, "SwapManager: prefetch must be >= 0, got ", options.prefetch);
  HP_CHECK(options.min_bytes >= 0, "SwapManager: min_bytes must be >= 0, got ", options.min_bytes);
  tier_ = detail::make_swap_tier(options);
  if (!options.inline_copies) copier_ = std::thread([this] { copy_loop(); });
}

SwapManager::Impl::~Impl() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (copier_.joinable()) copier_.join();
}

void SwapManager::Impl::copy_loop() {
  for (;;) {
    std::function<void()> copy;
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait(lock, [&] { return stopping_ || !copies_.empty(); });
      if (copies_.empty()) return;  // stopping, nothing left
      copy = std::move(copies_.front());
      copies_.pop_front();
    }
    copy();
  }
}

void SwapManager::Impl::run_copy(std::function<void()> copy) {
  if (options.inline_copies) {
    copy();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    copies_.push_back(std::move(copy));
  }
  changed_.notify_all();
}

// Hands a copy's failure to the region's thread, once: the slot it concerned is settled (kept in
// place, or lost with the backward that throws), so later steps may go on.
void SwapManager::Impl::throw_if_failed() {
  if (failure_.empty()) return;
  HP_FAIL("activation swap: a copy on the copy thread failed: ", std::exchange(failure_, std::string()));
}

namespace {

// What `copy` threw, or "" when it returned.
template <typename Copy>
std::string error_of(Copy&& copy) {
  try {
    copy();
    return "";
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown exception";
  }
}

}  // namespace

// Slot by slot, allocating before a slot's state changes: a failed allocation leaves no slot in a
// copying state without its copy queued (which forget() would wait for). A failed write leaves the
// tensor where it was.
void SwapManager::Impl::copy_out(const std::shared_ptr<SwapRegion>& region) {
  for (size_t i = 0; i < region->slots_.size(); ++i) {
    SwapRegion::Slot& slot = region->slots_[i];
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (slot.state != State::kResident || slot.pinned) continue;
      if (slot.device.is_meta()) {  // a dry run: the bytes leave the count at once, as a copy would take them
        swapped_out(slot);
        continue;
      }
    }
    detail::SwapTier::Buffer stored = tier_->acquire(slot.bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot.stored = std::move(stored);
      slot.state = State::kCopyingOut;
    }
    run_copy([this, region, i] {
      SwapRegion::Slot& s = region->slots_[i];
      const std::string failed = error_of([&] { tier_->write(s.stored, s.tensor.data_ptr()); });
      std::lock_guard<std::mutex> lock(mu_);
      if (failed.empty()) {
        swapped_out(s);
      } else {
        tier_->release(s.stored);
        s.state = State::kResident;
        if (failure_.empty()) failure_ = failed;
      }
      changed_.notify_all();
    });
  }
}

void SwapManager::Impl::swapped_out(SwapRegion::Slot& slot) {
  slot.tensor = at::Tensor();  // the compute allocator's memory goes back now
  slot.state = State::kSwapped;
  ++counts_.swapped_tensors;
  counts_.swapped_bytes += slot.bytes;
}

void SwapManager::Impl::reloaded(SwapRegion::Slot& slot) {
  tier_->release(slot.stored);  // none for a dry run's slot
  slot.state = State::kReloaded;
  counts_.reloaded_bytes += slot.bytes;
}

bool SwapManager::Impl::start_reload(const std::shared_ptr<SwapRegion>& region) {
  bool started = false;
  for (size_t i = 0; i < region->slots_.size(); ++i) {
    SwapRegion::Slot& slot = region->slots_[i];
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait(lock, [&] { return slot.state != State::kCopyingOut; });
      if (slot.state != State::kSwapped) continue;
    }
    // Allocated here, on the thread that runs the region: its compute memory is counted there.
    at::Tensor tensor = at::empty(slot.shape, at::TensorOptions().dtype(slot.dtype).device(slot.device));
    started = true;
    if (slot.device.is_meta()) {  // a dry run: nothing to read back
      std::lock_guard<std::mutex> lock(mu_);
      slot.tensor = std::move(tensor);
      reloaded(slot);
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot.tensor = std::move(tensor);
      slot.state = State::kCopyingIn;
    }
    run_copy([this, region, i] {
      SwapRegion::Slot& s = region->slots_[i];
      const std::string failed = error_of([&] { tier_->read(s.stored, s.tensor.data_ptr()); });
      std::lock_guard<std::mutex> lock(mu_);
      if (failed.empty()) {
        reloaded(s);
      } else {
        s.tensor = at::Tensor();
        s.state = State::kSwapped;  // lost: the backward that waits for it throws
        if (failure_.empty()) failure_ = failed;
      }
      changed_.notify_all();
    });
  }
  return started;
}

std::shared_ptr<SwapRegion> SwapManager::Impl::replace_pending(const std::shared_ptr<SwapRegion>& next) {
  std::lock_guard<std::mutex> lock(mu_);
  throw_if_failed();
  std::shared_ptr<SwapRegion> leaving = pending_.lock();
  pending_ = next;
  if (next) order_.push_back(next);
  return leaving;
}

void SwapManager::Impl::after_forward(const std::shared_ptr<SwapRegion>& region) {
  if (const auto leaving = replace_pending(region)) copy_out(leaving);
}

std::shared_ptr<SwapRegion> SwapManager::Impl::later_forward_ended() {
  const auto leaving = replace_pending(nullptr);
  if (leaving) copy_out(leaving);
  return leaving;
}

void SwapManager::Impl::reload_ahead(const std::shared_ptr<SwapRegion>& region) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if_failed();
  }
  start_reload(region);
}

void SwapManager::Impl::before_backward(const std::shared_ptr<SwapRegion>& region) {
  std::vector<std::shared_ptr<SwapRegion>> next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if_failed();
    if (pending_.lock() == region) pending_.reset();  // never left: its backward comes first
    auto it = std::find_if(order_.begin(), order_.end(), [&](const auto& r) { return r.lock() == region; });
    if (it == order_.end()) it = order_.begin();  // not swapped: nothing to prefetch for
    // The regions whose backward comes next: those before it in forward order, nearest first.
    for (auto back = it; back != order_.begin() && static_cast<int>(next.size()) < options.prefetch;) {
      --back;
      if (auto r = back->lock()) next.push_back(std::move(r));
    }
  }
  if (start_reload(region)) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_.reload_waits;
  }
  for (const auto& r : next) start_reload(r);
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [&] {
    return !failure_.empty() ||
           std::all_of(region->slots_.begin(), region->slots_.end(), [](const SwapRegion::Slot& s) {
             return s.state == State::kResident || s.state == State::kReloaded;
           });
  });
  throw_if_failed();
}

void SwapManager::Impl::after_backward(SwapRegion& region) { forget(region); }

void SwapManager::Impl::forget(SwapRegion& region) {
  std::unique_lock<std::mutex> lock(mu_);
  // Copies in flight write into the region's buffers: let them finish.
  changed_.wait(lock, [&] {
    return std::none_of(region.slots_.begin(), region.slots_.end(), [](const SwapRegion::Slot& s) {
      return s.state == State::kCopyingOut || s.state == State::kCopyingIn;
    });
  });
  for (SwapRegion::Slot& slot : region.slots_) {
    slot.tensor = at::Tensor();
    tier_->release(slot.stored);
    slot.state = State::kResident;
  }
  region.slots_.clear();
  if (pending_.lock().get() == &region) pending_.reset();
  order_.erase(std::remove_if(order_.begin(), order_.end(),
                              [&](const auto& r) {
                                const auto alive = r.lock();
                                return !alive || alive.get() == &region;
                              }),
               order_.end());
}

SwapStats SwapManager::Impl::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  SwapStats s = counts_;
  s.pool_in_use = tier_->in_use();
  s.pool_held = tier_->held();
  return s;
}

SwapManager::SwapManager(SwapOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
SwapManager::~SwapManager() = default;
const SwapOptions& SwapManager::options() const { return impl_->options; }
SwapStats SwapManager::stats() const { return impl_->stats(); }

}  // namespace hp
