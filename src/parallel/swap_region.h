// SwapManager's working parts, for hp::checkpoint: one region's swapped outputs, the tier and the
// copy engine.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hp/parallel/activation_swap.h"
#include "parallel/swap_tier.h"

namespace hp::detail {

// One call's outputs that a policy swapped, in the order the first pass made them.
class SwapRegion {
 public:
  enum class State { kResident, kCopyingOut, kSwapped, kCopyingIn, kReloaded };
  struct Slot {
    at::Tensor tensor;  // in the compute allocator: until copied out, and again once reloaded
    std::vector<int64_t> shape;
    at::ScalarType dtype;
    at::Device device = at::kCPU;  // where it is reloaded to; a dry run's meta tensors move no bytes
    int64_t bytes = 0;
    SwapTier::Buffer stored;  // in the tier: while copying out, swapped, copying in
    State state = State::kResident;
    bool pinned = false;  // stays in place (it is also the region's output)
  };
  // Keeps `output` (contiguous, >= min_bytes) for the region's backward; returns its slot.
  size_t add(const at::Tensor& output);
  // The slot's tensor in the compute allocator, once SwapManager::Impl::before_backward returned.
  at::Tensor get(size_t slot) const;
  bool empty() const { return slots_.empty(); }
  // Keeps the slots sharing storage with `t` in place; returns how many, and their bytes.
  std::pair<int64_t, int64_t> pin_aliases_of(const at::Tensor& t);
  // Lets go of a slot's tensor: it will not be asked for.
  void drop(size_t slot);

 private:
  friend struct hp::SwapManager::Impl;
  std::vector<Slot> slots_;
};

}  // namespace hp::detail

namespace hp {

struct SwapManager::Impl {
  explicit Impl(SwapOptions o);
  ~Impl();

  // The first pass of `region` ended: the region before it may now leave (see activation_swap.h).
  void after_forward(const std::shared_ptr<detail::SwapRegion>& region);
  // The forward of a module that runs after the swapped regions ended (a block that swaps nothing):
  // the region before it leaves too, as before the next region. Returns that region, if any.
  std::shared_ptr<detail::SwapRegion> later_forward_ended();
  // Starts bringing `region` back ahead of its backward, from a backward that comes before it
  // other than a swapped region's (which starts its own prefetches).
  void reload_ahead(const std::shared_ptr<detail::SwapRegion>& region);
  // Backward reached `region`: its tensors must be back when this returns; reloads of the regions
  // whose backward comes next start.
  void before_backward(const std::shared_ptr<detail::SwapRegion>& region);
  // Its backward is done: its buffers go back to the pool.
  void after_backward(detail::SwapRegion& region);
  // The region is gone (its graph freed, with or without backward).
  void forget(detail::SwapRegion& region);

  SwapOptions options;
  SwapStats stats() const;

 private:
  // `next` is the region whose outputs wait for the next forward's end now (null: none); returns
  // the one that did, which is to leave.
  std::shared_ptr<detail::SwapRegion> replace_pending(const std::shared_ptr<detail::SwapRegion>& next);
  void copy_out(const std::shared_ptr<detail::SwapRegion>& region);
  // Starts the region's reloads; whether any had not started before.
  bool start_reload(const std::shared_ptr<detail::SwapRegion>& region);
  // A slot's tensor has left for the tier, or come back from it (mu_ held).
  void swapped_out(detail::SwapRegion::Slot& slot);
  void reloaded(detail::SwapRegion::Slot& slot);
  void run_copy(std::function<void()> copy);
  void copy_loop();
  // Throws a failure of the copy engine, once (on the region's thread); mu_ held.
  void throw_if_failed();

  mutable std::mutex mu_;  // slot states, the order, the counters
  std::condition_variable changed_;
  std::unique_ptr<detail::SwapTier> tier_;
  std::string failure_;  // a copy that failed: the next forward or backward throws it
  // Regions with swapped outputs, in forward order; `pending_`'s outputs have not left yet.
  std::vector<std::weak_ptr<detail::SwapRegion>> order_;
  std::weak_ptr<detail::SwapRegion> pending_;
  SwapStats counts_;
  // The copy engine.
  std::deque<std::function<void()>> copies_;
  bool stopping_ = false;
  std::thread copier_;
};

}  // namespace hp
