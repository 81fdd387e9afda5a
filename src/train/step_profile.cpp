#include "train/step_profile.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "hp/core/log.h"

namespace hp::train::detail {
namespace {

using Row = std::pair<std::string, OpTimer::Time>;

std::vector<Row> slowest_first(const std::map<std::string, OpTimer::Time>& times) {
  std::vector<Row> rows(times.begin(), times.end());
  std::stable_sort(rows.begin(), rows.end(),
                   [](const Row& a, const Row& b) { return a.second.seconds > b.second.seconds; });
  return rows;
}

void write_rows(std::ostream& out, const std::vector<Row>& rows, double step_seconds) {
  for (const auto& [name, t] : rows)
    out << std::left << std::setw(52) << name << std::right << std::setw(10) << std::setprecision(4) << t.seconds
        << std::setw(8) << std::setprecision(1) << 100.0 * t.seconds / step_seconds << "%" << std::setw(9) << t.calls
        << "\n";
}

}  // namespace

StepProfile::StepProfile(bool profiled) {
  if (!profiled) return;
  timer_ = std::make_unique<OpTimer>();
  timing_ = std::make_unique<DispatchModeGuard>(*timer_);
  timing_kernels_ = std::make_unique<KernelObserverGuard>(timer_.get());
}

StepProfile::~StepProfile() = default;

void StepProfile::finish(const TrainConfig& c, int64_t step, double seconds) {
  if (!timer_) return;
  timing_kernels_.reset();
  timing_.reset();
  std::vector<Row> classes = slowest_first(timer_->by_class());
  const double outside = std::max(0.0, seconds - timer_->total_seconds());
  classes.push_back({"outside ops and kernels (autograd, collectives, hp code)", {outside, 0}});
  const std::string path = (std::filesystem::path(c.run_dir) / "profile.txt").string();
  std::ofstream out(path);
  out << std::fixed << "step " << step << " on rank 0: " << std::setprecision(4) << seconds
      << " s (timing every op costs a little of it)\n\n"
      << std::left << std::setw(52) << "class" << std::right << std::setw(10) << "seconds" << std::setw(9) << "share"
      << std::setw(9) << "calls\n";
  write_rows(out, classes, seconds);
  const std::vector<Row> ops = slowest_first(timer_->by_op());
  out << "\n"
      << std::left << std::setw(52) << "op (the 25 slowest)" << std::right << std::setw(10) << "seconds" << std::setw(9)
      << "share" << std::setw(9) << "calls\n";
  write_rows(out, std::vector<Row>(ops.begin(), ops.begin() + std::min<size_t>(ops.size(), 25)), seconds);
  std::ostringstream summary;
  summary << std::fixed << std::setprecision(0);
  for (const auto& [name, t] : classes)
    summary << (&name == &classes.front().first ? "" : ", ") << name.substr(0, name.find(" (")) << " "
            << 100.0 * t.seconds / seconds << "%";
  log::info("profile of step ", step, " on rank 0: ", summary.str(), "; ", path);
}

}  // namespace hp::train::detail
