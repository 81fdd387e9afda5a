// Activation swap: the outputs a checkpointed region keeps (hp/parallel/checkpoint.h) moved out of
// the compute allocator into a second memory tier between forward and backward, and brought back
// ahead of the backward that needs them.
//
//   auto swap = std::make_shared<hp::SwapManager>();            // host tier, prefetch 1
//   for (auto& [fqn, block] : hp::nn::match_modules(model, "layers.*"))
//     hp::checkpoint(*block, {hp::default_swap_policy, swap});
//
// A region's policy answers kMustSwap for the ops whose outputs go to the tier (default_swap_policy:
// the matrix products and attention probabilities). Its backward then rebuilds the region's graph
// from the swapped outputs and recomputes only what the policy did not keep. How the tier works:
//  - a region's outputs leave when the next region's forward ends (with hp::checkpoint_modules, the
//    next module's among those after the first swapped one, swapped or not: with prefetch >= 1 that
//    module's backward then starts the region's reload ahead): the last region's forward before
//    backward stays resident, since its backward comes first;
//  - copies run on one copy thread (a side stream is the CUDA build's counterpart); a tensor's
//    compute memory is released when its copy completes;
//  - the tier keeps buffers for reuse by size: the host tier, in host memory outside the
//    compute allocator; the file tier, in an unnamed file of SwapOptions::directory, written through
//    and dropped from the page cache, so that the process's resident memory does not hold them;
//  - when backward reaches a region, the reloads of the `prefetch` regions whose backward comes next
//    start too, so that with prefetch >= 1 backward finds its tensors on their way back.
// Never swapped: outputs under `min_bytes`, non-contiguous ones (both stay in place), and parameters
// (which no op outputs). Gradients are bitwise those without swapping. A tier that fails raises
// hp::Error saying why: reserving space for a region's outputs fails the forward of the region
// or module after it (when they leave); a failed copy fails the next forward or backward of a
// swapped region (or, with hp::checkpoint_modules, the forward of a module after one, or its
// backward where it starts a reload ahead), once (a failed write leaves the tensor in place;
// a failed read fails that backward).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace hp {

struct SwapOptions {
  int prefetch = 1;               // regions reloaded ahead of the backward that needs them
  int64_t min_bytes = 64 * 1024;  // smaller outputs stay in the compute allocator
  bool inline_copies = false;     // copies run when started, on the thread that starts them: a
                                  // deterministic copy engine (tests count reload waits with it)
  enum class Tier { kHost, kFile };
  Tier tier = Tier::kHost;
  std::string directory;  // the file tier's, on a disk (a tmpfs is memory); made if missing
};

struct SwapStats {
  int64_t swapped_tensors = 0, swapped_bytes = 0;  // moved out to the tier since the manager started
  int64_t reloaded_bytes = 0;                      // brought back
  int64_t reload_waits = 0;  // region backwards that found their reload not started before they needed it
  int64_t pool_in_use = 0;   // bytes of the tier's buffers holding swapped tensors now
  int64_t pool_held = 0;     // bytes of the tier's buffers allocated, in use or kept for reuse
};

class SwapManager {
 public:
  explicit SwapManager(SwapOptions options = {});
  ~SwapManager();
  SwapManager(const SwapManager&) = delete;
  SwapManager& operator=(const SwapManager&) = delete;

  const SwapOptions& options() const;
  SwapStats stats() const;

  struct Impl;  // used by hp::checkpoint
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace hp
