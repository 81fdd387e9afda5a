// Implementation of hp::log: level parsed once from HP_LOG_LEVEL, one mutex so lines never interleave.
#include "hp/core/log.h"

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>

namespace hp::log {
namespace {

thread_local int t_rank = -1;

Level level_from_env() {
  const char* env = std::getenv("HP_LOG_LEVEL");
  if (env == nullptr) return Level::kInfo;
  if (std::strcmp(env, "debug") == 0) return Level::kDebug;
  if (std::strcmp(env, "warn") == 0) return Level::kWarn;
  if (std::strcmp(env, "error") == 0) return Level::kError;
  return Level::kInfo;
}

const char* name(Level level) {
  switch (level) {
    case Level::kDebug:
      return "D";
    case Level::kInfo:
      return "I";
    case Level::kWarn:
      return "W";
    case Level::kError:
      return "E";
  }
  return "?";
}

}  // namespace

bool enabled(Level level) {
  static const Level threshold = level_from_env();
  return level >= threshold;
}

void write(Level level, const std::string& message) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << "[hp " << name(level);
  if (t_rank >= 0) std::cerr << " rank " << t_rank;
  std::cerr << "] " << message << std::endl;
}

LogRankGuard::LogRankGuard(int rank) : previous_(t_rank) { t_rank = rank; }
LogRankGuard::~LogRankGuard() { t_rank = previous_; }

}  // namespace hp::log
