// Where a thread's compute time goes, by ATen op and by class of op: a DispatchMode that times every
// op it sees (below autograd and DTensor: forward and backward ops alike, DTensor's local ops).
//
//   hp::OpTimer timer;
//   {
//     hp::DispatchModeGuard on(timer);
//     loss.backward();
//   }
//   timer.by_class();  // {"matmul": {seconds, calls}, "elementwise": ...}
//
// An op's time includes the ops it calls (they are not seen separately), so times never count
// twice and their sum is the thread's time inside ATen ops; intra-op worker threads are part of
// the op that started them. An op that returns a CUDA tensor waits for the device before its clock
// stops (device build), so its time is what it took on the GPU, and the timed region runs
// synchronously. It is also a kernel observer (hp/core/kernel_observer.h): set as the thread's
// observer, it times hp's own kernels too, as ops named "hp::<kernel>" of the class "hp kernel".
// Time outside both (autograd bookkeeping, collectives, the caller's own code) is the wall time of
// the region minus their sum.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hp/core/dispatch_mode.h"
#include "hp/core/kernel_observer.h"

namespace hp {

class OpTimer : public DispatchMode, public KernelObserver {
 public:
  struct Time {
    double seconds = 0.0;
    int64_t calls = 0;
  };

  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override;
  void kernel_ran(const char* name, int64_t bytes, double seconds) override;

  const std::map<std::string, Time>& by_op() const { return ops_; }
  // The ops summed by op_class.
  std::map<std::string, Time> by_class() const;
  double total_seconds() const;

 private:
  std::map<std::string, Time> ops_;
};

// The class of an ATen op by its name ("aten::mm" -> "matmul"): matmul, elementwise, reduction,
// copy and cast, indexing, allocation and fill, view, other; "hp kernel" for hp's own ("hp::...").
std::string op_class(const std::string& op_name);

}  // namespace hp
