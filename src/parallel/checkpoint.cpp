#include "hp/parallel/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include "hp/core/dispatch_mode.h"
#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"
#include "hp/core/memory_timeline.h"
#include "hp/core/recompute.h"
#include "hp/core/weight_split.h"
#include "hp/nn/moe.h"
#include "parallel/swap_region.h"

namespace hp {
namespace detail {

struct CheckpointRegion {
  std::string name;
  CheckpointOptions options;
  CheckpointStats stats;
};

}  // namespace detail

namespace {

using detail::CheckpointRegion;

bool is_matmul(const std::string& name) {
  const std::string base = name.substr(0, name.find('.'));
  return base == "aten::mm" || base == "aten::addmm" || base == "aten::bmm" || base == "aten::baddbmm";
}

// Whether a saved output can stand in for running `op`: its results are fresh tensors (no views,
// nothing written in place) and it reads no random state.
bool can_save(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& schema = op.schema();
  if (schema.is_mutable() || schema.returns().empty()) return false;
  for (const c10::Argument& a : schema.arguments()) {
    c10::TypePtr type = a.type();
    if (const auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
    if (type->kind() == c10::TypeKind::GeneratorType) return false;  // draws random numbers
  }
  for (const c10::Argument& r : schema.returns())
    if (r.alias_info() != nullptr || r.type()->kind() != c10::TypeKind::TensorType) return false;
  return true;
}

// The ops a policy saved in one forward of a region, by (op, index among that op's calls).
struct SavedOutput {
  at::Tensor alias;   // kept in place: an alias sharing the output's version counter; else undefined
  int64_t slot = -1;  // swapped: its slot in the call's SwapRegion
  int64_t version;    // the version when saved: in-place changes afterwards show
  int64_t bytes = 0;
  // Written in place later in the region through a tensor sharing its storage without sharing its
  // version counter (matmul returns an _unsafe_view of bmm's output: `matmul(a, b).mul_(s)`
  // changes bmm's saved output and bumps only the view's version). Released at once: an output
  // overwritten block by block (attention's scores) must not pile up until the region ends.
  bool overwritten = false;
};
struct SavedOp {
  std::vector<std::vector<int64_t>> input_shapes;  // to check that the recomputation asks the same
  std::vector<SavedOutput> outputs;
};
using SavedOps = std::map<std::pair<std::string, int64_t>, SavedOp>;

std::vector<std::vector<int64_t>> tensor_shapes(const c10::IValue* args, size_t n) {
  std::vector<std::vector<int64_t>> shapes;
  for (size_t i = 0; i < n; ++i)
    if (args[i].isTensor() && args[i].toTensor().defined()) shapes.push_back(args[i].toTensor().sizes().vec());
  return shapes;
}

// Whether a saved output is as the op left it: not written in place since (its version), and still
// backed by its storage (plan machinery such as FSDP's release frees storage in place).
bool intact(const SavedOutput& out, const detail::SwapRegion* swapped) {
  if (out.overwritten) return false;  // released already
  const at::Tensor& saved = out.slot < 0 ? out.alias : swapped->get(static_cast<size_t>(out.slot));
  const auto needed = static_cast<size_t>((saved.storage_offset() + saved.numel()) * saved.element_size());
  return saved._version() == out.version && saved.storage().nbytes() >= needed;
}

// Lets go of a saved output that will not be used, and takes it off the stats.
void release_saved(SavedOutput& out, detail::SwapRegion* swapped, CheckpointStats& stats) {
  if (out.slot < 0) {
    out.alias = at::Tensor();
    --stats.saved_tensors;
    stats.saved_bytes -= out.bytes;
  } else {
    swapped->drop(static_cast<size_t>(out.slot));
    --stats.swapped_tensors;
    stats.swapped_bytes -= out.bytes;
  }
}

// Counts each op name's calls, and the matrix products, in one forward of a region.
class OpIndex {
 public:
  CheckpointOp next(const std::string& name) {
    CheckpointOp op{name, calls_[name]++, -1};
    if (is_matmul(name)) op.matmul_index = matmuls_++;
    return op;
  }

 private:
  std::map<std::string, int64_t> calls_;
  int64_t matmuls_ = 0;
};

// First pass of a selective region: runs every op, keeping the outputs of those the policy saves
// (in place, or in `swap`'s slots when it swaps them).
class SavingMode : public DispatchMode {
 public:
  SavingMode(const CheckpointPolicyFn& policy, SavedOps& saved, CheckpointStats& stats, detail::SwapRegion* swap,
             int64_t swap_min_bytes)
      : policy_(policy), saved_(saved), stats_(stats), swap_(swap), swap_min_bytes_(swap_min_bytes) {}

  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override {
    note_writes(op, *stack);
    if (NotRegionComputation::active()) return run_below(op, keys, stack);
    const CheckpointOp call = index_.next(op_name(op));
    const CheckpointPolicy decision = policy_(call);
    const bool swap = decision == CheckpointPolicy::kMustSwap;
    HP_CHECK(!swap || swap_ != nullptr, "checkpoint: the policy swaps ", call.name,
             "'s output, but the region has no SwapManager (CheckpointOptions::swap)");
    const bool save =
        (swap || decision == CheckpointPolicy::kMustSave || decision == CheckpointPolicy::kPreferSave) && can_save(op);
    const size_t nargs = op.schema().arguments().size();
    SavedOp entry;
    if (save) entry.input_shapes = tensor_shapes(stack->data() + stack->size() - nargs, nargs);
    run_below(op, keys, stack);
    if (!save) return;
    const size_t nret = op.schema().returns().size();
    for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
      const at::Tensor& out = (*stack)[i].toTensor();
      // An alias without autograd history (autograd records the original after we return), sharing
      // its version counter so that a later in-place change to the output is detected.
      at::Tensor alias = out.variable_data();
      alias.unsafeGetTensorImpl()->set_version_counter(out.unsafeGetTensorImpl()->version_counter());
      const int64_t bytes = static_cast<int64_t>(out.numel()) * static_cast<int64_t>(out.element_size());
      SavedOutput saved{{}, -1, out._version(), bytes};
      if (swap && bytes >= swap_min_bytes_ && out.is_contiguous()) {
        saved.slot = static_cast<int64_t>(swap_->add(alias));
        ++stats_.swapped_tensors;
        stats_.swapped_bytes += bytes;
      } else {
        saved.alias = std::move(alias);
        ++stats_.saved_tensors;
        stats_.saved_bytes += bytes;
      }
      by_storage_[out.storage().unsafeGetStorageImpl()].push_back({{call.name, call.index}, entry.outputs.size()});
      entry.outputs.push_back(std::move(saved));
    }
    saved_[{call.name, call.index}] = std::move(entry);
  }

 private:
  // Marks the saved outputs whose storage `op` writes in place, through a tensor argument or a
  // tensor list (the _foreach_ ops, list out= forms).
  void note_writes(const c10::OperatorHandle& op, const OpStack& stack) {
    if (by_storage_.empty()) return;
    const std::vector<c10::Argument>& args = op.schema().arguments();
    const size_t base = stack.size() - args.size();
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].alias_info() == nullptr || !args[i].alias_info()->isWrite()) continue;
      const c10::IValue& value = stack[base + i];
      if (value.isTensor()) note_write(value.toTensor());
      if (value.isTensorList())
        for (const at::Tensor& t : value.toTensorList().vec()) note_write(t);
    }
  }

  void note_write(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const auto it = by_storage_.find(t.storage().unsafeGetStorageImpl());
    if (it == by_storage_.end()) return;
    for (const auto& [key, index] : it->second) {
      SavedOutput& out = saved_[key].outputs[index];
      if (out.overwritten) continue;
      release_saved(out, swap_, stats_);
      out.overwritten = true;
    }
  }

  const CheckpointPolicyFn& policy_;
  SavedOps& saved_;
  CheckpointStats& stats_;
  detail::SwapRegion* swap_;
  int64_t swap_min_bytes_;
  OpIndex index_;
  std::map<const c10::StorageImpl*, std::vector<std::pair<std::pair<std::string, int64_t>, size_t>>> by_storage_;
};

// The recomputation of a selective region: ops the first pass saved return their saved outputs.
class ReplayMode : public DispatchMode {
 public:
  ReplayMode(const std::string& region, const SavedOps& saved, CheckpointStats& stats, const detail::SwapRegion* swap)
      : region_(region), saved_(saved), stats_(stats), swap_(swap) {}

  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override {
    if (NotRegionComputation::active()) return run_below(op, keys, stack);
    const CheckpointOp call = index_.next(op_name(op));
    const auto it = saved_.find({call.name, call.index});
    if (it == saved_.end()) {
      ++stats_.recomputed_ops;
      run_below(op, keys, stack);
      return;
    }
    const SavedOp& entry = it->second;
    const size_t nargs = op.schema().arguments().size();
    HP_CHECK(tensor_shapes(stack->data() + stack->size() - nargs, nargs) == entry.input_shapes,
             "selective checkpointing: the recomputation of ", region_, " called ", call.name, " (call ", call.index,
             ") on inputs of other shapes than its forward did; the region's forward must run the same way both times");
    for (const SavedOutput& out : entry.outputs)
      HP_CHECK(intact(out, swap_), "selective checkpointing: ", region_, ": the output of ", call.name, " (call ",
               call.index,
               ") was changed or freed in place after its region's forward; save another op's output or recompute "
               "this one");
    torch::jit::drop(*stack, nargs);
    for (const SavedOutput& out : entry.outputs) stack->emplace_back(saved_tensor(out).variable_data());
    ++stats_.replayed_ops;
  }

 private:
  at::Tensor saved_tensor(const SavedOutput& out) const {
    return out.slot < 0 ? out.alias : swap_->get(static_cast<size_t>(out.slot));
  }
  const std::string& region_;
  const SavedOps& saved_;
  CheckpointStats& stats_;
  const detail::SwapRegion* swap_;
  OpIndex index_;
};

// The CPU generator's state for a scope (torch.random.fork_rng), restored afterwards. Kept as plain
// bytes, outside the tensor allocator, so that a region's forward holds exactly its activations.
class CpuGeneratorState {
 public:
  using Bytes = std::vector<uint8_t>;
  static Bytes now() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    const at::Tensor state = gen.get_state();
    return Bytes(state.data_ptr<uint8_t>(), state.data_ptr<uint8_t>() + state.numel());
  }
  explicit CpuGeneratorState(const Bytes& state) : previous_(now()) { set(state); }
  ~CpuGeneratorState() { set(previous_); }
  CpuGeneratorState(const CpuGeneratorState&) = delete;
  CpuGeneratorState& operator=(const CpuGeneratorState&) = delete;

 private:
  static void set(Bytes state) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(at::from_blob(state.data(), {static_cast<int64_t>(state.size())}, at::kByte));
  }
  Bytes previous_;
};

// The parameters a region's modules hold when its call starts, each once, and where they sit.
// Inside a larger FSDP unit these are the unit's gathered tensors, which the unit swaps out after
// its forward and refills before its backward reaches the region: the recomputation puts them back.
struct RegionParameters {
  std::vector<at::Tensor> tensors;                                  // distinct, in module order
  std::vector<std::tuple<nn::Module*, std::string, size_t>> slots;  // (module, name, index in tensors)

  static RegionParameters of(nn::Module& root) {
    RegionParameters params;
    std::map<const c10::TensorImpl*, size_t> index;
    for (auto& [fqn, m] : root.named_modules_fqn())
      for (const auto& item : m->named_parameters(/*recurse=*/false)) {
        const at::Tensor& p = item.value();
        const auto [it, added] = index.emplace(p.unsafeGetTensorImpl(), params.tensors.size());
        if (added) params.tensors.push_back(p);
        params.slots.emplace_back(m, item.key(), it->second);
      }
    return params;
  }
};

// Puts `replacements` (one per RegionParameters tensor) in the modules for a scope, then puts back
// what was there.
class InstalledParameters {
 public:
  InstalledParameters(const RegionParameters& params, const std::vector<at::Tensor>& replacements) : params_(params) {
    try {
      for (const auto& [module, name, i] : params.slots) {
        previous_.push_back(module->param(name));
        module->set_param(name, replacements[i]);
      }
    } catch (...) {
      put_back();
      throw;
    }
  }
  ~InstalledParameters() { put_back(); }
  InstalledParameters(const InstalledParameters&) = delete;
  InstalledParameters& operator=(const InstalledParameters&) = delete;

 private:
  void put_back() {
    for (size_t k = 0; k < previous_.size(); ++k)
      std::get<0>(params_.slots[k])->set_param(std::get<1>(params_.slots[k]), previous_[k]);
  }
  const RegionParameters& params_;
  std::vector<at::Tensor> previous_;  // of the slots installed so far
};

// What a call's recomputation built: fresh leaves for its inputs and parameters, and its output
// through the graph they start.
struct Recomputed {
  nn::Inputs leaves;
  std::vector<at::Tensor> param_leaves;
  at::Tensor out;
};

// What the I pass of a split backward leaves for its W: the leaves of the recomputation (its graph
// lives on in `split`, which W finishes), which inputs I answered (the others' gradients come in
// W, with the parameters'), and the output gradient I got, which W must get again.
struct WeightPass {
  Recomputed recomputed;  // its output dropped: W starts where the parameters' branches leave the path
  std::vector<bool> answered;
  at::Tensor grad;
  std::shared_ptr<WeightGradientSplit> split;
};

// What one call of a region keeps for its recomputation.
struct Call {
  explicit Call(const std::string& region) : record(region) {}
  const void* module = nullptr;  // the region's, to label what its recomputation allocates
  RecomputeRecord record;
  SavedOps saved;
  CpuGeneratorState::Bytes cpu_generator_state;
  double aux_loss_scale = 1.0;
  std::vector<at::Tensor> inputs;  // detached
  std::vector<bool> inputs_require_grad;
  RegionParameters params;
  std::vector<int64_t> versions;                // of the inputs, then the parameters, when the call started
  bool swap_released = false;                   // its backward ran and gave the swapped outputs back
  std::shared_ptr<SwapManager> swap;            // the region's tier, or null
  std::shared_ptr<detail::SwapRegion> swapped;  // this call's outputs in it
  std::optional<WeightPass> pending_w;          // between the I and the W pass of a split backward
  ~Call() {
    if (swapped) swap->impl().forget(*swapped);
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
};

// `tensors` as leaves of a new graph: same values, same requires_grad.
std::vector<at::Tensor> fresh_leaves(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& t : tensors) leaves.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
  return leaves;
}
nn::Inputs fresh_leaves(const std::vector<at::Tensor>& inputs, const std::vector<bool>& require_grad) {
  nn::Inputs leaves;
  for (size_t i = 0; i < inputs.size(); ++i)
    leaves.push_back(inputs[i].defined() ? inputs[i].detach().requires_grad_(require_grad[i]) : inputs[i]);
  return leaves;
}

// Wall time since it was made.
class Stopwatch {
 public:
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Runs the region's call under `pass`, with `mode` seeing its ops when there is one.
at::Tensor run_pass(const nn::Module::Run& run, nn::Inputs inputs, ForwardPass pass, Call& call, DispatchMode* mode) {
  ForwardPassScope scope(pass, &call.record);
  std::optional<DispatchModeGuard> on;
  if (mode) on.emplace(*mode);
  return run(std::move(inputs));
}

// The recomputation reads the call's inputs and parameters as they are now: they must be as the
// forward saw them (autograd's own check for the tensors it saves).
void check_versions(const CheckpointRegion& region, const Call& call) {
  size_t k = 0;
  for (const at::Tensor& x : call.inputs)
    HP_CHECK(!x.defined() || x._version() == call.versions[k++], "checkpoint: input ", k - 1, " of ", region.name,
             " was changed in place after its forward; the recomputation would see other values");
  for (const at::Tensor& p : call.params.tensors)
    HP_CHECK(p._version() == call.versions[k++], "checkpoint: a parameter of ", region.name,
             " was changed in place between its forward and backward; the recomputation would see other values");
}

// Recomputes the call on fresh leaves (the inputs and the parameters the call started with),
// its swapped outputs reloaded, the outputs its first pass saved replayed.
Recomputed recompute(CheckpointRegion& region, const nn::Module::Run& run, Call& call) {
  HP_CHECK(!at::GradMode::is_enabled(), "checkpoint: ", region.name,
           ": a backward that records its own graph (create_graph, double backward) through a checkpointed region "
           "is not supported");
  HP_CHECK(
      !call.swap_released, "checkpoint: ", region.name,
      ": a second backward through a swapped region (retain_graph) is not supported; its swapped outputs are gone");
  check_versions(region, call);
  at::AutoGradMode grad_mode(true);
  const CpuGeneratorState generator(call.cpu_generator_state);
  const nn::AuxLossScale aux_scale(call.aux_loss_scale);
  Recomputed r{fresh_leaves(call.inputs, call.inputs_require_grad), fresh_leaves(call.params.tensors), {}};
  call.record.rewind();
  region.stats.recomputed_ops = region.stats.replayed_ops = 0;
  const Stopwatch recomputing_time;
  if (call.swapped) call.swap->impl().before_backward(call.swapped);
  std::optional<ReplayMode> replay;
  if (region.options.policy) replay.emplace(region.name, call.saved, region.stats, call.swapped.get());
  {
    const InstalledParameters installed(call.params, r.param_leaves);
    const MemoryLabel recomputing(MemoryLabel::kModule, call.module);  // the region's activations again
    r.out = run_pass(run, r.leaves, ForwardPass::kRecompute, call, replay ? &*replay : nullptr);
  }
  region.stats.recompute_seconds = recomputing_time.seconds();
  call.record.check_all_taken();
  HP_CHECK(r.out.requires_grad(), "checkpoint: the recomputation of ", region.name,
           " gave an output that does not require grad, unlike its forward");
  return r;
}

// The call's backward is over: its swapped outputs go back to the tier's pool.
void release_swapped(Call& call) {
  if (!call.swapped || call.swap_released) return;
  call.swap->impl().after_backward(*call.swapped);
  call.swap_released = true;
}

// W after I: the parameters' gradients from the graph I rebuilt, and those of the inputs I did not
// answer (an input off the path to the stage's input reaches parameters too). W comes with the
// output gradient I recorded.
std::vector<at::Tensor> weight_pass(const CheckpointRegion& region, Call& call, const std::vector<size_t>& edge_inputs,
                                    const std::vector<size_t>& edge_params, const at::Tensor& grad) {
  const WeightPass w = std::move(*call.pending_w);
  call.pending_w.reset();
  w.split->weight_gradients();
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < edge_inputs.size(); ++k)
    grads.push_back(w.answered[k] ? at::Tensor() : w.recomputed.leaves[edge_inputs[k]].grad());
  for (size_t i : edge_params) grads.push_back(w.recomputed.param_leaves[i].grad());
  return grads;
}

// The backward of one call: recompute, then backward through the recomputed graph, and hand the
// leaves' gradients to the node's edges. Parameters that FSDP units inside the region gather
// themselves get theirs through those units' reduce-scatters, run by this nested backward.
//
// A backward split into I and W (a zero-bubble pipeline's, hp/core/weight_split.h) asks the node
// for its inputs' gradients alone, keeping the graph, then for its parameters' alone: I
// recomputes, computes the inputs' gradients through a split of the rebuilt graph and keeps it; W
// finishes that split. The region recomputes once and its weight gradients wait for W, as the
// stage's do.
std::vector<at::Tensor> call_backward(CheckpointRegion& region, const nn::Module::Run& run, Call& call,
                                      const std::vector<size_t>& edge_inputs, const std::vector<size_t>& edge_params,
                                      const at::Tensor& grad, const std::vector<bool>& asked) {
  const size_t inputs = edge_inputs.size();
  if (call.pending_w) {
    // The W of that I: the split restarts the node with the gradient I got, and asks for none of
    // the inputs I answered. Another backward (a second autograd::grad, a backward() after one
    // that kept the graph) recomputes again.
    bool w = grad.is_same(call.pending_w->grad);
    for (size_t k = 0; k < inputs; ++k) w = w && !(asked[k] && call.pending_w->answered[k]);
    if (w) return weight_pass(region, call, edge_inputs, edge_params, grad);
    call.pending_w.reset();
  }
  std::vector<bool> answered(asked.begin(), asked.begin() + static_cast<std::ptrdiff_t>(inputs));
  const bool inputs_asked = std::find(answered.begin(), answered.end(), true) != answered.end();
  const bool params_asked =
      std::find(asked.begin() + static_cast<std::ptrdiff_t>(inputs), asked.end(), true) != asked.end();
  Recomputed r = recompute(region, run, call);
  // A backward that keeps its graph may come back for the parameters' gradients (a split
  // backward's W): the rebuilt graph waits for it. One that lets the graph go never comes back.
  const bool graph_kept = torch::autograd::get_current_graph_task_keep_graph();
  std::vector<at::Tensor> grads(inputs + edge_params.size());
  bool whole = false;
  // Something left for a W: parameters, or inputs off the path to the inputs asked for.
  const bool left_for_w = !edge_params.empty() || std::find(answered.begin(), answered.end(), false) != answered.end();
  if (inputs_asked && !params_asked && left_for_w) {
    std::vector<at::Tensor> leaves;  // of the inputs asked for; the others count as parameters
    for (size_t k = 0; k < inputs; ++k)
      if (answered[k]) leaves.push_back(r.leaves[edge_inputs[k]]);
    std::shared_ptr<WeightGradientSplit> split;
    if (graph_kept) split = WeightGradientSplit::prepare_for_leaves(r.out, leaves);
    const std::vector<at::Tensor> dx =
        split ? split->input_gradients(r.out, leaves, grad)  // I
              : torch::autograd::grad({r.out}, leaves, {grad}, graph_kept, /*create_graph=*/false,
                                      /*allow_unused=*/true);
    for (size_t k = 0, j = 0; k < inputs; ++k)
      if (answered[k]) grads[k] = dx[j++];
    if (split) {
      r.out.reset();
      call.pending_w = WeightPass{std::move(r), std::move(answered), grad, std::move(split)};
    }
  } else {
    torch::autograd::backward({r.out}, {grad});
    for (size_t k = 0; k < inputs; ++k) grads[k] = r.leaves[edge_inputs[k]].grad();
    for (size_t k = 0; k < edge_params.size(); ++k) grads[inputs + k] = r.param_leaves[edge_params[k]].grad();
    whole = true;
  }
  // The outputs the first pass saved serve another recomputation: none comes after I (W takes the
  // rebuilt graph) or once the graph is let go. Swapped ones serve one backward: they go then, or
  // after a whole one.
  const bool recomputed_for_good = call.pending_w || !graph_kept;
  if (recomputed_for_good) call.saved.clear();
  if (recomputed_for_good || whole) release_swapped(call);
  return grads;
}

// After the first pass: outputs the region changed after they were saved (an empty_like filled in
// place) are dropped, their ops recomputed; the swapped outputs leave for the tier (once the next
// region's forward ends), except those that are also the region's output, which the caller holds.
void settle_saved(CheckpointRegion& region, Call& call, const at::Tensor& result) {
  for (auto it = call.saved.begin(); it != call.saved.end();) {
    bool keep = true;
    for (const SavedOutput& out : it->second.outputs) keep = keep && intact(out, call.swapped.get());
    if (keep) {
      ++it;
      continue;
    }
    for (SavedOutput& out : it->second.outputs)
      if (!out.overwritten) release_saved(out, call.swapped.get(), region.stats);
    it = call.saved.erase(it);
  }
  if (!call.swapped) return;
  const auto [pinned, pinned_bytes] = call.swapped->pin_aliases_of(result);
  region.stats.swapped_tensors -= pinned;
  region.stats.swapped_bytes -= pinned_bytes;
  region.stats.saved_tensors += pinned;
  region.stats.saved_bytes += pinned_bytes;
  if (!call.swapped->empty()) call.swap->impl().after_forward(call.swapped);
}

at::Tensor checkpointed_call(const std::shared_ptr<CheckpointRegion>& region, nn::Module& module, nn::Inputs inputs,
                             const nn::Module::Run& run) {
  if (forward_pass() != ForwardPass::kPlain || !at::GradMode::is_enabled()) return run(std::move(inputs));
  const Stopwatch forward_time;
  auto call = std::make_shared<Call>(region->name);
  call->module = &module;
  call->cpu_generator_state = CpuGeneratorState::now();
  call->aux_loss_scale = nn::AuxLossScale::current();
  call->params = RegionParameters::of(module);
  for (const at::Tensor& x : inputs) {
    call->inputs.push_back(x.defined() ? x.detach() : x);  // shares x's version counter
    call->inputs_require_grad.push_back(x.defined() && x.requires_grad());
    if (x.defined()) call->versions.push_back(x._version());
  }
  for (const at::Tensor& p : call->params.tensors) call->versions.push_back(p._version());
  region->stats = {};
  if ((call->swap = region->options.swap)) call->swapped = std::make_shared<detail::SwapRegion>();
  std::optional<SavingMode> saving;
  if (region->options.policy)
    saving.emplace(region->options.policy, call->saved, region->stats, call->swapped.get(),
                   call->swap ? call->swap->options().min_bytes : 0);
  at::Tensor out = run_pass(run, fresh_leaves(call->inputs, call->inputs_require_grad), ForwardPass::kFirst, *call,
                            saving ? &*saving : nullptr);
  const bool differentiable = out.requires_grad();
  at::Tensor result = out.detach();
  out.reset();  // the first pass's graph, and with it every activation it saved, goes here
  if (!differentiable) return result;
  settle_saved(*region, *call, result);
  region->stats.forward_seconds = forward_time.seconds();

  // The node's edges: the inputs and the parameters that require grad.
  std::vector<at::Tensor> edges;
  std::vector<size_t> edge_inputs, edge_params;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (call->inputs_require_grad[i]) {
      edges.push_back(inputs[i]);
      edge_inputs.push_back(i);
    }
  for (size_t i = 0; i < call->params.tensors.size(); ++i)
    if (call->params.tensors[i].requires_grad()) {
      edges.push_back(call->params.tensors[i]);
      edge_params.push_back(i);
    }
  HP_CHECK(!edges.empty(), "checkpoint: the output of ", region->name,
           " requires grad through a tensor that is neither its input nor its parameter; a checkpointed module may "
           "read only those (and tensors that need no gradient)");
  return record_trimmed_backward(
      "checkpoint(" + region->name + ")", edges, result,
      [region, run, call, edge_inputs, edge_params](const at::Tensor& grad, const std::vector<bool>& asked) {
        return call_backward(*region, run, *call, edge_inputs, edge_params, grad, asked);
      });
}

}  // namespace

CheckpointPolicy default_swap_policy(const CheckpointOp& op) {
  return op.matmul_index >= 0 || op.name == "aten::_softmax" ? CheckpointPolicy::kMustSwap
                                                             : CheckpointPolicy::kPreferRecompute;
}

CheckpointPolicy default_checkpoint_policy(const CheckpointOp& op) {
  if (op.matmul_index >= 0)
    return op.matmul_index % 2 == 0 ? CheckpointPolicy::kPreferSave : CheckpointPolicy::kPreferRecompute;
  if (op.name == "aten::_softmax") return CheckpointPolicy::kPreferSave;
  return CheckpointPolicy::kPreferRecompute;
}

const CheckpointStats& CheckpointedModule::stats() const { return region_->stats; }
const std::shared_ptr<SwapManager>& CheckpointedModule::swap() const { return region_->options.swap; }

CheckpointedModule checkpoint(nn::Module& module, CheckpointOptions options) {
  auto region = std::make_shared<CheckpointRegion>();
  region->name = module.name();
  region->options = std::move(options);
  HP_CHECK(!region->options.swap || region->options.policy, "checkpoint: ", module.name(),
           " has a SwapManager but no policy to choose what it swaps (e.g. hp::default_swap_policy)");
  HP_CHECK(!module.has_call_wrapper(), "checkpoint: ", module.name(),
           " is already checkpointed (or another plan wraps its calls)");
  module.set_call_wrapper([region](nn::Module& m, nn::Inputs inputs, const nn::Module::Run& run) {
    return checkpointed_call(region, m, std::move(inputs), run);
  });
  return CheckpointedModule(region);
}

std::optional<CheckpointMode> checkpoint_mode_named(const std::string& name, bool swap) {
  for (CheckpointMode mode : {CheckpointMode::kNone, CheckpointMode::kFull, CheckpointMode::kSelective})
    if (name == checkpoint_mode_name(mode)) return mode;
  if (swap && name == checkpoint_mode_name(CheckpointMode::kSwap)) return CheckpointMode::kSwap;
  return std::nullopt;
}

const char* checkpoint_mode_name(CheckpointMode mode) {
  switch (mode) {
    case CheckpointMode::kNone:
      return "none";
    case CheckpointMode::kFull:
      return "full";
    case CheckpointMode::kSelective:
      return "selective";
    case CheckpointMode::kSwap:
      return "swap";
  }
  return "?";
}

std::vector<CheckpointedModule> checkpoint_modules(nn::Module& root, const std::string& pattern, CheckpointMode mode,
                                                   SwapOptions swap) {
  std::vector<CheckpointedModule> regions;
  if (mode == CheckpointMode::kNone) return regions;
  const size_t matches = nn::match_modules(root, pattern).size();
  for (auto& [fqn, region] :
       checkpoint_modules(root, pattern, std::vector<CheckpointMode>(matches, mode), std::move(swap)))
    regions.push_back(std::move(region));
  return regions;
}

namespace {

// `module` comes after a swapped one and swaps nothing: the end of its forward (with grad: not an
// evaluation, not its recomputation) sends the swapped region before it away, as the next swapped
// region's would, so that a lone swapped block leaves too. No swapped region's backward comes
// before that region's to start its reload ahead (with prefetch): the module's own backward starts
// it, a plain module's when backward reaches its output, a checkpointed one's when its
// recomputation runs (its first pass's output is dropped), for the regions that left at its
// forwards in their order (a pipeline runs backwards in the order of their forwards).
void send_away_after(nn::Module& module, const std::shared_ptr<SwapManager>& manager) {
  auto left = std::make_shared<std::deque<std::weak_ptr<detail::SwapRegion>>>();
  const bool ahead = manager->options().prefetch >= 1;
  module.register_forward_hook([manager, left, ahead](nn::Module&, const nn::Inputs&, at::Tensor& output) {
    SwapManager::Impl& swap = manager->impl();
    const ForwardPass pass = forward_pass();
    if (pass == ForwardPass::kRecompute) {
      while (!left->empty()) {
        const std::shared_ptr<detail::SwapRegion> region = left->front().lock();
        left->pop_front();
        if (region) {
          const NotRegionComputation machinery;  // in a recomputation only: not one of the region's ops
          swap.reload_ahead(region);
          break;
        }
      }
      return;
    }
    if (!at::GradMode::is_enabled()) return;
    const NotRegionComputation machinery;  // in a first pass only: not an op its recomputation replays
    const std::shared_ptr<detail::SwapRegion> gone = swap.later_forward_ended();
    if (!gone || !ahead) return;
    if (pass == ForwardPass::kFirst) {
      while (!left->empty() && left->front().expired()) left->pop_front();  // their graphs are gone
      left->push_back(gone);
    } else if (output.requires_grad()) {
      output.register_hook([manager, weak = std::weak_ptr<detail::SwapRegion>(gone)](const at::Tensor& grad) {
        if (const auto region = weak.lock()) manager->impl().reload_ahead(region);
        return grad;
      });
    }
  });
}

}  // namespace

std::vector<std::pair<std::string, CheckpointedModule>> checkpoint_modules(nn::Module& root, const std::string& pattern,
                                                                           const std::vector<CheckpointMode>& modes,
                                                                           SwapOptions swap) {
  const auto matches = nn::match_modules(root, pattern);
  HP_CHECK(modes.size() == matches.size(), "checkpoint_modules: ", modes.size(), " modes for the ", matches.size(),
           " modules matching '", pattern, "'");
  std::shared_ptr<SwapManager> manager;
  if (std::count(modes.begin(), modes.end(), CheckpointMode::kSwap) > 0)
    manager = std::make_shared<SwapManager>(std::move(swap));
  std::vector<std::pair<std::string, CheckpointedModule>> regions;
  bool after_swap = false;
  for (size_t i = 0; i < matches.size(); ++i) {
    if (after_swap && modes[i] != CheckpointMode::kSwap) send_away_after(*matches[i].second, manager);
    after_swap = after_swap || modes[i] == CheckpointMode::kSwap;
    CheckpointOptions options;
    if (modes[i] == CheckpointMode::kNone) continue;
    if (modes[i] == CheckpointMode::kSelective) options.policy = default_checkpoint_policy;
    if (modes[i] == CheckpointMode::kSwap) options = {default_swap_policy, manager};
    regions.emplace_back(matches[i].first, checkpoint(*matches[i].second, options));
  }
  return regions;
}

}  // namespace hp
