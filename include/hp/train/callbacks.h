// Callbacks: code that runs at fixed points of hp::train::train, on every rank, in the order they
// were given (after the built-in metrics log, which is one of them: metrics.jsonl and the progress
// line on rank 0). A callback that needs a collective must make the same calls on every rank.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hp::train {

struct TrainResult;

// What running a step again on an anomaly showed (resilience.rerun_on_anomaly): other numbers, a
// transient fault of the hardware; the same numbers (or an anomaly again), the data or the model.
enum class Rerun { kNone, kTransient, kPersistent };

// One finished step, as metrics.jsonl records it (docs/training.md says what each number means).
struct StepRecord {
  int64_t step = 0;  // 1-based: the number of optimizer steps taken so far, skipped ones included
  double loss = 0, grad_norm = 0, lr = 0, tokens_per_s = 0, mfu = 0, seconds = 0, peak_mem_bytes = 0;
  std::vector<double> local_losses, local_grad_norms;  // indexed by world rank
  int64_t largest_local_grad_norm_rank = 0;
  bool skipped = false;             // not finite, with train.on_nonfinite: skip
  Rerun rerun = Rerun::kNone;       // the step ran again on an anomaly; the numbers are the rerun's
  std::optional<double> eval_loss;  // when this step ended with an evaluation
  // What the model family's step hook reported (a mixture of experts' loads).
  std::vector<std::pair<std::string, double>> model_values;
  std::string model_summary;
};

class Callback {
 public:
  virtual ~Callback() = default;
  virtual void on_train_begin(int64_t first_step) {}  // 0, or the step a resumed run starts from
  virtual void on_step_begin(int64_t step) {}         // the 1-based step about to run
  // Forward and backward of `step` have run: its gradients are reduced, not yet clipped. Called again
  // when the step runs again from its start (a rerun on an anomaly, docs/resilience.md).
  virtual void on_after_backward(int64_t step) {}
  // The gradients of `step` are reduced and clipped, and the optimizer is about to apply them (not
  // called for a skipped step).
  virtual void on_before_optimizer_step(int64_t step) {}
  virtual void on_step_end(const StepRecord& record) {}
  virtual void on_eval(int64_t step, double eval_loss) {}
  // A checkpoint of `step` started saving into `dir` (it is committed during a later step, or at
  // the end of the run).
  virtual void on_save(int64_t step, const std::string& dir) {}
  virtual void on_train_end(const TrainResult& result) {}
  // train() is about to rethrow `error`, which a step (1-based) threw.
  virtual void on_exception(int64_t step, const std::exception& error) {}
};

}  // namespace hp::train
