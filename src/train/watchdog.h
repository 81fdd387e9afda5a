// The last of the timeouts (docs/resilience.md#timeouts): a rank that makes no progress for too long
// ends its process. A hang that no collective timeout catches (every rank stuck, or a rank stuck
// outside any collective) would otherwise hold the job, and its machines, forever; ended, it is
// a failure hprun reports and --max-restarts restarts.
//
// Progress is any callback event (a step beginning, its backward ending, the step ending, an
// evaluation, a save beginning) and what the trainer reports between them with progress() (each
// batch of the final evaluation, each sampled token, the last checkpoint's commit). The bound is fixed, or derived: the
// larger of the collective timeout + 60 s and 10x the slowest step so far, so that a collective that is stuck is
// reported (naming its missing ranks) first.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "hp/train/callbacks.h"

namespace hp::train::detail {

class Watchdog : public Callback {
 public:
  using Expiry = std::function<void(const std::string& message)>;
  static constexpr int kExitCode = 3;

  // fixed 0: derived from collective_timeout and the steps' times. Default expiry: write the
  // message to stderr and _Exit(kExitCode).
  // margin: how much longer than the collective timeout a derived bound is at least.
  Watchdog(int rank, std::chrono::seconds fixed, std::chrono::milliseconds collective_timeout, Expiry expiry = {},
           std::chrono::milliseconds margin = std::chrono::seconds(60));
  ~Watchdog() override;
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // The bound now (it grows with the slowest step when derived).
  std::chrono::milliseconds bound() const;
  // "collective 300 s (+2 s to name missing ranks) < watchdog 360 s (derived: ...)".
  std::string describe() const;
  // The rank is alive and doing `doing` ("evaluating batch 3 of 8"): the clock starts again.
  void progress(std::string doing);

  void on_train_begin(int64_t first_step) override;
  void on_step_begin(int64_t step) override;
  void on_after_backward(int64_t step) override;  // each run of a step (a rerun doubles one)
  void on_step_end(const StepRecord& record) override;
  void on_eval(int64_t step, double eval_loss) override;
  void on_save(int64_t step, const std::string& dir) override;
  void on_train_end(const TrainResult& result) override;
  void on_exception(int64_t step, const std::exception& error) override;

 private:
  using Clock = std::chrono::steady_clock;
  void stop();
  void watch();
  std::chrono::milliseconds bound_locked() const;

  const int rank_;
  const std::chrono::seconds fixed_;
  const std::chrono::milliseconds collective_timeout_;
  const std::chrono::milliseconds margin_;
  Expiry expiry_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool started_ = false, stopping_ = false;
  Clock::time_point last_progress_, step_start_;
  std::chrono::milliseconds slowest_step_{0};
  bool warned_fixed_too_short_ = false;
  std::string doing_;  // what the rank was doing since its last progress
  std::thread thread_;
};

}  // namespace hp::train::detail
