// The cost model's recorder: each op's cost class, size and work (and time), by phase.
#include "train/work_recorder.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <chrono>

#include "hp/core/memory_timeline.h"
#include "hp/core/op_counter.h"
#include "hp/core/op_timer.h"
#include "hp/core/recompute.h"
#include "hp/core/step_phase.h"

namespace hp::train::detail {
namespace {

double bytes_of(const c10::IValue& v) {
  const auto one = [](const at::Tensor& t) { return t.defined() ? static_cast<double>(t.nbytes()) : 0.0; };
  if (v.isTensor()) return one(v.toTensor());
  double sum = 0.0;
  if (v.isTensorList())
    for (const at::Tensor& t : v.toTensorVector()) sum += one(t);
  return sum;
}

double bytes_of(const OpStack& stack, size_t first) {
  double sum = 0.0;
  for (size_t i = first; i < stack.size(); ++i) sum += bytes_of(stack[i]);
  return sum;
}

}  // namespace

WorkRecorder::WorkRecorder(StepWork* work, bool timed) : work_(work), timed_(timed) {
  collectives_.set_listener([this](const char* op, int64_t bytes, int group_size) {
    CollectiveWork& c = phase().collectives[{op, group_size}];
    ++c.calls;
    c.bytes += static_cast<double>(bytes);
  });
}

PhaseWork& WorkRecorder::phase() {
  if (optimizer_phase_) return work_->optimizer;
  switch (step_phase()) {
    case StepPhase::kForward:
      return work_->forward;
    case StepPhase::kBackward:
      return work_->backward;
    case StepPhase::kUnknown:
      break;
  }
  return at::GradMode::is_enabled() && !recomputing() ? work_->forward : work_->backward;
}

void WorkRecorder::add(const std::string& cost_class, double work, double seconds) {
  OpWork& w = phase().ops[{cost_class, work_size(work)}];
  ++w.calls;
  w.work += work;
  if (timed_) samples_.push_back({cost_class, work, seconds});
}

void WorkRecorder::dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) {
  // A collective's own ops (its buffers, its reductions: on a group's worker thread in a real run,
  // at once in a dry run's fake world) are its cost, which the calibration's lines measure.
  if (const MemoryLabel* label = MemoryLabel::innermost();
      label != nullptr && label->kind() == MemoryLabel::kCommunication)
    return run_below(op, keys, stack);
  const std::string name = op_name(op);
  const size_t first_argument = stack->size() - op.schema().arguments().size();
  // A matrix product's work is its FLOPs (its arguments share one dtype, which sets its speed), a
  // view's nothing, anything else's the bytes of its tensor arguments and results.
  std::string cost_class = op_class(name);
  const int64_t flops = matmul_flops_of(name, stack->data() + first_argument);
  const bool by_bytes = flops < 0 && cost_class != "view";
  double work = 0.0;
  if (flops >= 0) {
    work = static_cast<double>(flops);
    cost_class += std::string(" ") + c10::toString((*stack)[first_argument].toTensor().scalar_type());
  } else if (by_bytes) {
    work = bytes_of(*stack, first_argument);
  }
  const auto start = std::chrono::steady_clock::now();
  run_below(op, keys, stack);
  const double seconds = timed_ ? std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() : 0.0;
  if (by_bytes) work += bytes_of(*stack, stack->size() - op.schema().returns().size());
  add(cost_class, work, seconds);
}

void WorkRecorder::kernel_ran(const char* name, int64_t bytes, double seconds) {
  add(std::string("kernel ") + name, static_cast<double>(bytes), seconds);
}

}  // namespace hp::train::detail
