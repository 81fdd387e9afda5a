#include "train/metrics.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <vector>

#include "hp/core/error.h"

namespace hp::train::detail {
namespace fs = std::filesystem;

MetricsLog::MetricsLog(const std::string& run_dir, int64_t resume_step, bool progress)
    : tty_(::isatty(STDERR_FILENO) != 0), progress_(progress) {
  fs::create_directories(run_dir);
  const fs::path path = fs::path(run_dir) / "metrics.jsonl";
  if (resume_step >= 0 && fs::exists(path)) {
    std::ifstream in(path);
    std::vector<std::string> kept;
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t{0}) <= resume_step) kept.push_back(line);
    }
    std::ofstream rewrite(path, std::ios::trunc);
    for (const auto& line : kept) rewrite << line << "\n";
  }
  out_.open(path, resume_step >= 0 ? std::ios::app : std::ios::trunc);
  HP_CHECK(out_, "train: cannot write ", path.string());
}

void MetricsLog::write(const nlohmann::json& record) {
  // A sample from a barely trained model is arbitrary bytes, not always UTF-8, which JSON requires:
  // such bytes are written as U+FFFD rather than failing the run at its end.
  out_ << record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  out_.flush();
}

void MetricsLog::progress(const std::string& line, bool final) {
  if (!progress_) return;
  if (tty_ && !final) {
    std::cerr << "\r\033[K" << line << std::flush;
    line_open_ = true;
  } else {
    finish_progress();
    std::cout << line << std::endl;
  }
}

void MetricsLog::finish_progress() {
  if (line_open_) std::cerr << "\n";
  line_open_ = false;
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  else
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buf;
}

}  // namespace hp::train::detail
