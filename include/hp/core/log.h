// A small rank-prefixed logger. The level comes from HP_LOG_LEVEL (debug|info|warn|error, default
// info). The rank prefix is per thread (LogRankGuard), never process-global, so the in-process
// multi-rank harness prints the right rank for each thread.
#pragma once

#include <string>

#include "hp/core/error.h"

namespace hp::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

bool enabled(Level level);
void write(Level level, const std::string& message);

// Sets this thread's rank prefix for its lifetime and restores the previous one.
class LogRankGuard {
 public:
  explicit LogRankGuard(int rank);
  ~LogRankGuard();
  LogRankGuard(const LogRankGuard&) = delete;
  LogRankGuard& operator=(const LogRankGuard&) = delete;

 private:
  int previous_;
};

template <typename... Args>
void debug(const Args&... a) {
  if (enabled(Level::kDebug)) write(Level::kDebug, detail::str_cat(a...));
}
template <typename... Args>
void info(const Args&... a) {
  if (enabled(Level::kInfo)) write(Level::kInfo, detail::str_cat(a...));
}
template <typename... Args>
void warn(const Args&... a) {
  if (enabled(Level::kWarn)) write(Level::kWarn, detail::str_cat(a...));
}
template <typename... Args>
void error(const Args&... a) {
  if (enabled(Level::kError)) write(Level::kError, detail::str_cat(a...));
}

}  // namespace hp::log
