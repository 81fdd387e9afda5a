// Activation checkpointing applied from outside, like fully_shard: after forward, a checkpointed
// module keeps only its inputs (and, selectively, the outputs of ops a policy chooses); backward
// runs its forward again to rebuild the rest.
//
//   for (auto& [fqn, block] : hp::nn::match_modules(model, "layers.*"))
//     hp::checkpoint(*block);                                               // full
//   hp::checkpoint(*block, {hp::default_checkpoint_policy});                 // selective
//
// What holds:
//  - gradients are bitwise those of the same model without checkpointing: the recomputation runs
//    the region's forward exactly as the first time: with the same inputs, the same dropout masks
//    and distributed-RNG streams (hp/core/recompute.h), the CPU generator's state of that time, the
//    same MoE routing (replayed, not recomputed), and the saved ops' outputs where a policy saved
//    them;
//  - the whole call is checkpointed, hooks included: a checkpointed fully_shard unit gathers its
//    parameters again for the recomputation (once: in the recomputation it stays gathered for the
//    backward that follows) and reduce-scatters after it, as without checkpointing; tensor-parallel
//    hooks run again;
//  - counters of training forwards (MoE token counts, auxiliary losses) count the first pass only.
// How: the first pass runs the call on detached inputs, with autograd recording as usual, and drops
// the graph at once; one autograd node stands for the region, its edges the inputs and the
// parameters the region's modules held when the call started (inside a larger FSDP unit: the unit's
// gathered tensors, which the unit refills before backward reaches the region). Its backward puts
// those parameters back as fresh leaves, recomputes the call with autograd recording, runs a nested
// backward through it and hands the leaves' gradients to the edges. FSDP units inside the region
// reduce-scatter their own gradients in that nested backward.
//
// A backward split into an input pass and a weight pass (hp/core/weight_split.h, as zero-bubble
// pipeline schedules run it) asks the node first for the gradients of its inputs alone, keeping
// the graph: the node recomputes once, computes those from the rebuilt graph and keeps it. The
// split's weight pass restarts the node with the output gradient the input pass got, asking for
// none of the inputs that pass answered: the node takes the rest from that graph. Any backward of
// the inputs alone that keeps the graph (autograd::grad with retain_graph) is taken for such an
// input pass. Its rebuilt graph stays until the weight pass, until another backward through the
// region (which recomputes: a swapped region cannot, its outputs went after the first backward),
// or until the graph goes.
//
// Limits, each an hp::Error naming the region when broken: a region reads only its inputs, its
// parameters and tensors that need no gradient; its inputs and parameters do not change in place
// between its forward and backward; its backward does not record a graph (no create_graph), and a
// swapped region is backpropagated once. A region returns one tensor (hp::nn::Module's forward
// does). Under no_grad (evaluation) or inside another checkpointed region a checkpointed module
// runs plainly.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hp/nn/module.h"
#include "hp/parallel/activation_swap.h"

namespace hp {

// What a selective policy decides for one op of a region's forward. The Prefer forms behave as the
// Must forms (there is no compiler here to overrule them); they mark decisions an automatic
// strategy may change.
enum class CheckpointPolicy {
  kMustSave,
  kPreferSave,
  kMustRecompute,
  kPreferRecompute,
  kMustSwap,  // kept in CheckpointOptions::swap's tier between forward and backward
};

// One op of a checkpointed region's forward as a selective policy sees it: ATen ops below autograd
// and below DTensor (the ops on local pieces), in the order the forward runs them.
struct CheckpointOp {
  std::string name;           // "aten::mm", "aten::_softmax", ...
  int64_t index = 0;          // calls of this op earlier in the same forward of the region
  int64_t matmul_index = -1;  // matrix products (mm, addmm, bmm, baddbmm) earlier; -1 if not one
};
using CheckpointPolicyFn = std::function<CheckpointPolicy(const CheckpointOp& op)>;

// Saves the output of every other matrix product (the 1st, 3rd, ...) and the attention
// probabilities (aten::_softmax); recomputes everything else. Why: a product costs O(n*d) FLOPs
// per output element and everything else O(1), so saving products buys back most of the
// recomputation's time; saving every other one keeps half their memory (torchtitan's choice for
// the same reason); softmax outputs feed attention's backward and cost an exp per element to
// redo. Pointwise ops, norms and copies are recomputed: their memory is the bulk of a block's
// activations and their time a small part of it.
CheckpointPolicy default_checkpoint_policy(const CheckpointOp& op);

// Swaps the outputs of every matrix product and the attention probabilities (activation swap,
// hp/parallel/activation_swap.h) and recomputes the rest: backward recomputes no product, only the
// cheap ops between them, whose outputs are most of a block's bytes (see default_checkpoint_policy).
CheckpointPolicy default_swap_policy(const CheckpointOp& op);

struct CheckpointOptions {
  // Empty: full checkpointing (nothing inside the region is kept). Set: selective; asked once per
  // op of each forward. Only ops whose outputs are fresh tensors can be saved or swapped (not views,
  // in-place or out= ops, not ops that draw random numbers): a save or swap decision for another op
  // is taken as recompute.
  CheckpointPolicyFn policy;
  // Where kMustSwap outputs go (needs a policy); regions may share one manager. Null: none.
  std::shared_ptr<SwapManager> swap;
};

// A checkpointed region's counts: of its last forward (what it kept) and last recomputation.
struct CheckpointStats {
  int64_t saved_tensors = 0;    // op outputs a policy kept in place
  int64_t saved_bytes = 0;      // their bytes
  int64_t swapped_tensors = 0;  // op outputs a policy sent to the swap tier
  int64_t swapped_bytes = 0;    // their bytes
  int64_t recomputed_ops = 0;   // ops the recomputation ran again
  int64_t replayed_ops = 0;     // ops whose saved outputs it used instead
  // Wall seconds of the last forward (the first pass, and queueing the previous swapped region's
  // copies) and of the last recomputation (waiting for swapped outputs' reloads, and running the
  // forward again; not the backward through it): what the automatic memory strategy prices.
  double forward_seconds = 0.0, recompute_seconds = 0.0;
};

namespace detail {
struct CheckpointRegion;
}

class CheckpointedModule {
 public:
  explicit CheckpointedModule(std::shared_ptr<detail::CheckpointRegion> region) : region_(std::move(region)) {}
  const CheckpointStats& stats() const;
  // The region's swap manager (CheckpointOptions::swap); null when it swaps nothing.
  const std::shared_ptr<SwapManager>& swap() const;

 private:
  std::shared_ptr<detail::CheckpointRegion> region_;
};

// Makes every call of `module` checkpointed (its hooks included). Once per module; an error names a
// module that already is.
CheckpointedModule checkpoint(nn::Module& module, CheckpointOptions options = {});

// How a model recipe checkpoints its blocks (hp-train's memory.checkpoint and memory.swap).
enum class CheckpointMode {
  kNone,
  kFull,       // checkpoint(block)
  kSelective,  // checkpoint(block, {default_checkpoint_policy})
  kSwap,       // checkpoint(block, {default_swap_policy, manager}), one manager for all blocks
};
// The mode named "none", "full" or "selective" (memory.checkpoint's values), or also "swap" with
// `swap` (memory.blocks' values); nullopt for any other.
std::optional<CheckpointMode> checkpoint_mode_named(const std::string& name, bool swap = false);
// "none", "full", "selective" or "swap".
const char* checkpoint_mode_name(CheckpointMode mode);
// Checkpoints every module of `root` matching `pattern` (hp::nn::match_modules) as `mode` says;
// kSwap's manager takes `swap`.
std::vector<CheckpointedModule> checkpoint_modules(nn::Module& root, const std::string& pattern, CheckpointMode mode,
                                                   SwapOptions swap = {});
// The same with a mode per match, in model order (one each; an error says how many there are);
// the swapped ones share one manager, made with `swap`. Returns the checkpointed ones by FQN.
std::vector<std::pair<std::string, CheckpointedModule>> checkpoint_modules(nn::Module& root, const std::string& pattern,
                                                                           const std::vector<CheckpointMode>& modes,
                                                                           SwapOptions swap = {});

}  // namespace hp
