#include "hp/core/step_phase.h"

namespace hp {
namespace {
thread_local StepPhase current = StepPhase::kUnknown;
}  // namespace

StepPhase step_phase() { return current; }

StepPhaseScope::StepPhaseScope(StepPhase phase) : previous_(current) { current = phase; }

StepPhaseScope::~StepPhaseScope() { current = previous_; }

}  // namespace hp
