// What a thread's training step does, for the cost model (hp/train/cost_model.h): every op's cost
// class and work (but a collective's own: those made under a communication MemoryLabel), hp's own
// kernels' bytes, and every collective by name and group size, sorted into the step's phases. A
// dry run records the work on meta tensors; a calibration also times each op.
#pragma once

#include <string>
#include <vector>

#include "hp/comm/comm_debug_mode.h"
#include "hp/core/dispatch_mode.h"
#include "hp/core/kernel_observer.h"
#include "hp/train/cost_model.h"

namespace hp::train::detail {

class WorkRecorder : public DispatchMode, public KernelObserver {
 public:
  struct Sample {
    std::string cost_class;  // its size is work_size(work)
    double work = 0.0, seconds = 0.0;
  };

  // Records into `work` the ops of the thread while the recorder is its dispatch mode
  // (DispatchModeGuard), the kernels while it is its kernel observer (KernelObserverGuard), and
  // the collectives the thread issues while the recorder lives; with `timed`, every op's and
  // kernel's time too.
  WorkRecorder(StepWork* work, bool timed);
  WorkRecorder(const WorkRecorder&) = delete;
  WorkRecorder& operator=(const WorkRecorder&) = delete;

  // Ops and collectives from now on are the optimizer's (gradient clipping and its step) until
  // set back; otherwise they go to the pass the step's driver says (hp/core/step_phase.h), or
  // outside one, to forward while autograd records (and nothing is recomputed), else backward.
  void set_optimizer_phase(bool on) { optimizer_phase_ = on; }

  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override;
  void kernel_ran(const char* name, int64_t bytes, double seconds) override;

  const std::vector<Sample>& samples() const { return samples_; }

 private:
  PhaseWork& phase();
  void add(const std::string& cost_class, double work, double seconds);

  StepWork* work_;
  bool timed_, optimizer_phase_ = false;
  std::vector<Sample> samples_;
  comm::CommDebugMode collectives_;
};

}  // namespace hp::train::detail
