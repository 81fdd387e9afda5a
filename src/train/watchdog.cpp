#include "train/watchdog.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "hp/comm/failure_report.h"
#include "hp/core/log.h"

namespace hp::train::detail {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int kSlowestStepFactor = 10;

long long whole_seconds(milliseconds d) { return std::chrono::duration_cast<seconds>(d).count(); }

}  // namespace

Watchdog::Watchdog(int rank, seconds fixed, milliseconds collective_timeout, Expiry expiry, milliseconds margin)
    : rank_(rank), fixed_(fixed), collective_timeout_(collective_timeout), margin_(margin), expiry_(std::move(expiry)) {
  if (!expiry_)
    expiry_ = [](const std::string& message) {
      // Straight to the file descriptor: the hung thread may hold the log's lock or stdio's.
      const std::string line = message + "\n";
      [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, line.data(), line.size());
      std::_Exit(kExitCode);
    };
  thread_ = std::thread([this] { watch(); });
}

Watchdog::~Watchdog() { stop(); }

milliseconds Watchdog::bound_locked() const {
  if (fixed_.count() > 0) return fixed_;
  return std::max<milliseconds>(collective_timeout_ + margin_, kSlowestStepFactor * slowest_step_);
}

milliseconds Watchdog::bound() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bound_locked();
}

std::string Watchdog::describe() const {
  std::ostringstream out;
  out << "collective " << whole_seconds(collective_timeout_) << " s (+" << comm::kFailureReportWindow.count()
      << " s to name missing ranks) < watchdog " << whole_seconds(bound());
  if (fixed_.count() > 0)
    out << " s (resilience.watchdog_s)";
  else
    out << " s for now (derived: the larger of the collective timeout + " << whole_seconds(margin_) << " s and "
        << kSlowestStepFactor << "x the slowest step)";
  return out.str();
}

void Watchdog::progress(std::string doing) {
  std::lock_guard<std::mutex> lock(mu_);
  started_ = true;
  last_progress_ = Clock::now();
  doing_ = std::move(doing);
  wake_.notify_all();
}

void Watchdog::on_train_begin(int64_t first_step) { progress("starting at step " + std::to_string(first_step + 1)); }

void Watchdog::on_step_begin(int64_t step) {
  progress("in step " + std::to_string(step));
  std::lock_guard<std::mutex> lock(mu_);
  step_start_ = last_progress_;
}

void Watchdog::on_step_end(const StepRecord& record) {
  bool warn = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slowest_step_ = std::max(slowest_step_, std::chrono::duration_cast<milliseconds>(Clock::now() - step_start_));
    // A collective that starts late in a step times out up to a step later than one at its start:
    // a fixed bound shorter than that may end the rank before the timeout names who is missing.
    warn = fixed_.count() > 0 && !warned_fixed_too_short_ &&
           slowest_step_ + collective_timeout_ + comm::kFailureReportWindow >= fixed_;
    warned_fixed_too_short_ |= warn;
  }
  if (warn && rank_ == 0)
    log::warn("resilience.watchdog_s ", fixed_.count(), " s is not longer than the slowest step so far (",
              whole_seconds(slowest_step_), " s) + the collective timeout (", whole_seconds(collective_timeout_),
              " s) + ", comm::kFailureReportWindow.count(),
              " s: a collective stuck late in a step may end in the watchdog (exit 3) before its timeout names the "
              "missing ranks");
  progress("after step " + std::to_string(record.step));
}

void Watchdog::on_eval(int64_t step, double) { progress("after the evaluation at step " + std::to_string(step)); }
void Watchdog::on_after_backward(int64_t step) { progress("in step " + std::to_string(step) + ", after a backward"); }
void Watchdog::on_save(int64_t step, const std::string&) { progress("saving step " + std::to_string(step)); }
void Watchdog::on_train_end(const TrainResult&) { stop(); }
void Watchdog::on_exception(int64_t, const std::exception&) { stop(); }

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    wake_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void Watchdog::watch() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (stopping_) return;
    if (!started_) {
      wake_.wait(lock);
      continue;
    }
    const Clock::time_point deadline = last_progress_ + bound_locked();
    if (Clock::now() < deadline) {
      wake_.wait_until(lock, deadline);
      continue;
    }
    std::ostringstream message;
    message << "watchdog: rank " << rank_ << " made no progress for " << whole_seconds(bound_locked()) << " s ("
            << doing_ << "); ending the process with exit code " << kExitCode
            << " (timeouts: resilience.collective_timeout_s, resilience.watchdog_s; docs/resilience.md)";
    const std::string text = message.str();
    stopping_ = true;
    lock.unlock();
    expiry_(text);
    return;
  }
}

}  // namespace hp::train::detail
