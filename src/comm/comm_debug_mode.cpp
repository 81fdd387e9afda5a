#include "hp/comm/comm_debug_mode.h"

#include <sstream>

namespace hp::comm {
namespace {
thread_local CommDebugMode* innermost = nullptr;
}  // namespace

CommDebugMode::CommDebugMode() : outer_(innermost) { innermost = this; }

CommDebugMode::~CommDebugMode() { innermost = outer_; }

int64_t CommDebugMode::count(const std::string& op) const {
  auto it = counts_.find(op);
  return it == counts_.end() ? 0 : it->second;
}

int64_t CommDebugMode::total() const {
  int64_t n = 0;
  for (const auto& [op, k] : counts_) n += k;
  return n;
}

std::string CommDebugMode::str() const {
  std::ostringstream out;
  for (const auto& [op, k] : counts_) out << (out.tellp() > 0 ? ", " : "") << op << " x" << k;
  return out.str();
}

void note_collective(const char* op) {
  for (CommDebugMode* mode = innermost; mode != nullptr; mode = mode->outer_) ++mode->counts_[op];
}

}  // namespace hp::comm
