// The built-in callback that reports a run: metrics.jsonl (a config record, one record per step
// and per evaluation, a summary) and the progress line, on rank 0; config.json beside them.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "hp/train/callbacks.h"
#include "hp/train/config.h"
#include "train/metrics.h"

namespace hp::train::detail {

struct RunFacts {
  int64_t world_size = 1;
  double unigram_entropy = 0.0;  // of the corpus, in nats
  bool resume = false;           // a resumed run drops the records after its first step
  bool progress = true;
};

class MetricsCallback : public Callback {
 public:
  MetricsCallback(const TrainConfig& config, RunFacts facts);
  void on_train_begin(int64_t first_step) override;
  void on_step_end(const StepRecord& record) override;
  void on_eval(int64_t step, double eval_loss) override;
  void on_train_end(const TrainResult& result) override;

 private:
  const TrainConfig& config_;
  RunFacts facts_;
  std::optional<MetricsLog> log_;
  int64_t first_step_ = 0;
  std::chrono::steady_clock::time_point start_;  // of the run, set by on_train_begin
};

}  // namespace hp::train::detail
