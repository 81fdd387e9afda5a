#include "hp/core/dispatch_mode.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <mutex>
#include <optional>

#include "hp/core/error.h"

namespace hp {
namespace {

constexpr c10::DispatchKey kModeKey = c10::DispatchKey::PrivateUse2;
constexpr c10::BackendComponent kModeBit = c10::BackendComponent::PrivateUse2Bit;

// This thread's modes, outermost first. Only modes[0, active) are live: while a mode's dispatch
// runs, it and the modes after it are hidden.
thread_local std::vector<DispatchMode*> modes;
thread_local size_t active = 0;

// Adds (`add`) or removes bits of this thread's included key set for a scope, then undoes exactly
// what it changed. Raw bits, because DispatchKeySet's set difference (used by the c10 include and
// exclude guards on exit, and by exclusion itself) never clears backend bits such as ours.
class IncludedBits {
 public:
  IncludedBits(uint64_t bits, bool add) : add_(add) {
    c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
    const uint64_t now = local.included_.raw_repr();
    changed_ = add ? bits & ~now : bits & now;
    set(local, add ? now | changed_ : now & ~changed_);
  }
  ~IncludedBits() {
    c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
    const uint64_t now = local.included_.raw_repr();
    set(local, add_ ? now & ~changed_ : now | changed_);
  }
  IncludedBits(const IncludedBits&) = delete;
  IncludedBits& operator=(const IncludedBits&) = delete;

 private:
  static void set(c10::impl::LocalDispatchKeySet local, uint64_t included) {
    local.included_ = c10::DispatchKeySet(c10::DispatchKeySet::RAW, included);
    c10::impl::_force_tls_local_dispatch_key_set(local);
  }
  bool add_;
  uint64_t changed_ = 0;
};

// The mode key's bits: its functionality (Dense) with our backend, and the backend bit alone.
const uint64_t kModeKeyBits = c10::DispatchKeySet(kModeKey).raw_repr();
const uint64_t kModeBackendBit = c10::DispatchKeySet(kModeBit).raw_repr();

// Puts the mode key in this thread's key sets while any mode is pushed.
thread_local std::optional<IncludedBits> key_included;

// Sets `active` for a scope. With no live mode left, also takes our backend bit out of this
// thread's key sets, so that ops run from here (and what their kernels call) reach the kernels
// directly.
class ActiveModes {
 public:
  explicit ActiveModes(size_t count) : previous_(active) {
    active = count;
    if (count == 0) hidden_.emplace(kModeBackendBit, /*add=*/false);
  }
  ~ActiveModes() { active = previous_; }
  ActiveModes(const ActiveModes&) = delete;
  ActiveModes& operator=(const ActiveModes&) = delete;

 private:
  size_t previous_;
  std::optional<IncludedBits> hidden_;
};

void run_op_below(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) {
  // Live modes left (those pushed before the one running): the op goes through them first, via our
  // key again. None: to the kernel below our key (our bit is hidden by then, see ActiveModes).
  if (active > 0) {
    op.redispatchBoxed(keys, stack);
    return;
  }
  op.redispatchBoxed(keys.remove_backend(kModeBit), stack);
}

void mode_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) {
  // No live mode: a thread that inherited the key with the thread-local state but not the modes,
  // or one inside a DispatchModeSuspend.
  DispatchMode* mode = active == 0 ? nullptr : modes[active - 1];
  ActiveModes hide(active == 0 ? 0 : active - 1);
  if (mode == nullptr) {
    run_op_below(op, keys, stack);
    return;
  }
  mode->dispatch(op, keys, stack);
}

void register_mode_kernel() {
  static std::once_flag once;
  std::call_once(once, [] {
    static auto* library =
        new torch::Library(torch::Library::IMPL, "aten", kModeKey, __FILE__, __LINE__);  // lives for the process
    for (const std::string& name : backend_aten_ops()) {
      try {
        library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&mode_kernel>());
      } catch (const c10::Error&) {
        // already has a kernel for our key: nothing to add
      }
    }
  });
}

}  // namespace

void DispatchMode::dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) {
  run_op_below(op, keys, stack);
}

void DispatchMode::run_below(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) {
  run_op_below(op, keys, stack);
}

DispatchModeGuard::DispatchModeGuard(DispatchMode& mode) : depth_(modes.size()) {
  HP_CHECK(active == modes.size(), "DispatchModeGuard: cannot push a mode from inside a mode's dispatch");
  register_mode_kernel();
  if (modes.empty()) key_included.emplace(kModeKeyBits, /*add=*/true);
  modes.push_back(&mode);
  active = modes.size();
}

DispatchModeGuard::~DispatchModeGuard() {
  modes.resize(depth_);
  active = depth_;
  if (modes.empty()) key_included.reset();
}

struct DispatchModeSuspend::Saved {
  ActiveModes none{0};
};

DispatchModeSuspend::DispatchModeSuspend() : saved_(std::make_unique<Saved>()) {}
DispatchModeSuspend::~DispatchModeSuspend() = default;

std::string op_name(const c10::OperatorHandle& op) {
  const auto& n = op.schema().operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

std::vector<std::string> backend_aten_ops() {
  std::vector<std::string> names;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasSchema()) continue;
    if (handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) &&
        !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU))
      continue;
    names.push_back(op_name(*handle));
  }
  return names;
}

}  // namespace hp
