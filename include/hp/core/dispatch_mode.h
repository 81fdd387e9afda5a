// Dispatch modes: code that sees every ATen op a thread runs, below autograd and below DTensor
// (DESIGN 2.7). The basis of selective recomputation policies, op and FLOP counting, and memory
// accounting.
//
//   struct CountMatmuls : hp::DispatchMode {
//     int64_t mms = 0;
//     void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, hp::OpStack* stack) override {
//       if (hp::op_name(op) == "aten::mm") ++mms;
//       run_below(op, keys, stack);
//     }
//   } count;
//   {
//     hp::DispatchModeGuard on(count);  // this thread's ops reach `count` until the guard ends
//     loss.backward();                  // backward on the same thread is seen too
//   }
//
// What a mode sees: every ATen op called on this thread while its guard lives, after autograd has
// recorded it (so forward and backward ops alike) and, for DTensors, the ops DTensor runs on the
// local pieces (not the DTensor ops themselves). Ops that decompose (CompositeImplicitAutograd)
// are seen as the ops they decompose into. Ops a mode runs from inside `dispatch` (including
// through run_below) are not seen by that mode or the modes pushed after it; modes pushed before
// it see them. Dense tensors only (CPU, CUDA, meta); sparse and quantized tensors are not
// supported under a mode.
//
// Implementation: one private dispatch key (PrivateUse2, a backend key ordered below DTensor's
// PrivateUse3) included through thread-local state while a guard lives. With no guard alive the
// key is in no key set, so modes cost nothing when unused.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace c10 {
class OperatorHandle;
class DispatchKeySet;
struct IValue;
}  // namespace c10

namespace hp {

using OpStack = std::vector<c10::IValue>;

class DispatchMode {
 public:
  virtual ~DispatchMode() = default;
  // Runs `op`: the arguments are on `stack`; the results must be left there. The default runs it.
  virtual void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack);

 protected:
  // Runs the op below this mode (through the modes pushed before it, then the kernel).
  static void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack);
};

// Pushes `mode` on this thread's stack of modes for the guard's lifetime. Guards nest (LIFO).
class DispatchModeGuard {
 public:
  explicit DispatchModeGuard(DispatchMode& mode);
  ~DispatchModeGuard();
  DispatchModeGuard(const DispatchModeGuard&) = delete;
  DispatchModeGuard& operator=(const DispatchModeGuard&) = delete;

 private:
  size_t depth_;
};

// Hides this thread's modes for the scope: for bookkeeping that is not the computation a mode
// watches (DTensor's shape inference on meta tensors).
class DispatchModeSuspend {
 public:
  DispatchModeSuspend();
  ~DispatchModeSuspend();
  DispatchModeSuspend(const DispatchModeSuspend&) = delete;
  DispatchModeSuspend& operator=(const DispatchModeSuspend&) = delete;

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

// "aten::mm", "aten::add.Tensor", ...: an op's name with its overload.
std::string op_name(const c10::OperatorHandle& op);

// The ATen ops a kernel for a backend dispatch key must take to see all computation: every op
// without a CompositeImplicitAutograd decomposition (those decompose above the backend into ops
// it does see), and the few that have both a decomposition and a CPU kernel (the fused kernel is
// what plain tensors run). Names as op_name gives them.
std::vector<std::string> backend_aten_ops();

}  // namespace hp
