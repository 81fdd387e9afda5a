#include "hp/comm/comm_debug_mode.h"

#include <sstream>

namespace hp::comm {
namespace {
thread_local CommDebugMode* innermost = nullptr;
}  // namespace

CommDebugMode::CommDebugMode() : outer_(innermost) { innermost = this; }

CommDebugMode::~CommDebugMode() { innermost = outer_; }

int64_t CommDebugMode::count(const std::string& op) const {
  auto it = tallies_.find(op);
  return it == tallies_.end() ? 0 : it->second.count;
}

int64_t CommDebugMode::bytes(const std::string& op) const {
  auto it = tallies_.find(op);
  return it == tallies_.end() ? 0 : it->second.bytes;
}

int64_t CommDebugMode::on_wire(const std::string& op) const {
  auto it = tallies_.find(op);
  return it == tallies_.end() ? 0 : it->second.on_wire;
}

int64_t CommDebugMode::total() const {
  int64_t n = 0;
  for (const auto& [op, t] : tallies_) n += t.count;
  return n;
}

int64_t CommDebugMode::total_bytes() const {
  int64_t n = 0;
  for (const auto& [op, t] : tallies_) n += t.bytes;
  return n;
}

std::string CommDebugMode::str() const {
  std::ostringstream out;
  for (const auto& [op, t] : tallies_) {
    out << (out.tellp() > 0 ? ", " : "") << op << " x" << t.count << " (" << t.bytes << " B";
    if (t.on_wire > 0) out << ", " << t.on_wire << " on a low-precision wire";
    out << ")";
  }
  return out.str();
}

void note_collective(const char* op, int64_t bytes, int group_size, bool on_wire) {
  for (CommDebugMode* mode = innermost; mode != nullptr; mode = mode->outer_) {
    CommDebugMode::Tally& t = mode->tallies_[op];
    ++t.count;
    t.bytes += bytes;
    t.on_wire += on_wire ? 1 : 0;
    if (mode->listener_) mode->listener_(op, bytes, group_size);
  }
}

}  // namespace hp::comm
