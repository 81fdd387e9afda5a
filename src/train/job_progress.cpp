#include "train/job_progress.h"

#include <string>

#include "hp/core/job.h"
#include "hp/core/log.h"

namespace hp::train::detail {
namespace {

class JobProgress : public Callback {
 public:
  JobProgress(std::string dir, int attempt, int recovery)
      : dir_(std::move(dir)), attempt_(attempt), recovery_(recovery) {}

  void on_train_begin(int64_t first_step) override {
    write(recovery_ > 0 ? job::recovery_first_step_file(attempt_, recovery_) : job::first_step_file(attempt_),
          first_step);
  }
  void on_step_end(const StepRecord& record) override { write(job::last_step_file(attempt_), record.step); }

 private:
  // A report hprun cannot read costs only its summary: warn once, never stop training.
  void write(const std::string& name, int64_t step) {
    if (job::write_atomically(dir_ + "/" + name, std::to_string(step)) || warned_) return;
    warned_ = true;
    log::warn("could not write ", dir_, "/", name, " (hprun's restart summary will lack it)");
  }

  std::string dir_;
  int attempt_, recovery_;
  bool warned_ = false;
};

}  // namespace

std::shared_ptr<Callback> job_progress() {
  const std::optional<std::string> dir = job::dir();
  if (!dir) return nullptr;
  return std::make_shared<JobProgress>(*dir, job::restart_count(), job::recovery_count());
}

}  // namespace hp::train::detail
