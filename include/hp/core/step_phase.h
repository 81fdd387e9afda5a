// Which pass of a training step this thread runs, as the step's driver says (TrainStep around each
// micro-batch's forward and backward, the pipeline executor around its F, B, I and W actions): the
// cost model's recorders sort ops by it, where autograd's mode would mislead them (a forward's
// custom functions and collectives run with autograd off).
#pragma once

#include <cstdint>

namespace hp {

enum class StepPhase : uint8_t { kUnknown, kForward, kBackward };

// This thread's pass (kUnknown outside any scope).
StepPhase step_phase();

// Sets this thread's pass for the scope's lifetime (the previous one is restored after).
class StepPhaseScope {
 public:
  explicit StepPhaseScope(StepPhase phase);
  ~StepPhaseScope();
  StepPhaseScope(const StepPhaseScope&) = delete;
  StepPhaseScope& operator=(const StepPhaseScope&) = delete;

 private:
  StepPhase previous_;
};

}  // namespace hp
