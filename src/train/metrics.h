// What the trainer reports: JSON lines in the run directory (rank 0), and a human line per logged
// step (a rewriting progress line on a terminal, plain lines otherwise).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <string>

namespace hp::train::detail {

class MetricsLog {
 public:
  // Opens `<run_dir>/metrics.jsonl` for appending; `resume_step` >= 0 first drops the lines of steps
  // after it (a killed run's steps that the resumed run repeats).
  MetricsLog(const std::string& run_dir, int64_t resume_step, bool progress);
  void write(const nlohmann::json& record);
  void progress(const std::string& line, bool final = false);
  void finish_progress();

 private:
  std::ofstream out_;
  bool tty_;
  bool progress_;
  bool line_open_ = false;
};

std::string format_duration(double seconds);  // "1m05s"

}  // namespace hp::train::detail
