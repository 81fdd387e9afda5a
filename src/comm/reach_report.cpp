#include "comm/reach_report.h"

#include <thread>

namespace hp::comm::detail {
namespace {

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string member_key(const std::string& prefix, int rank) { return prefix + "member/" + std::to_string(rank); }

// Adds to `missing` the ranks in [first, last) whose record is absent: one request for a range
// that is complete, halving the ranges that are not.
void find_missing(c10d::Store& store, const std::string& prefix, int first, int last, std::vector<int>& missing) {
  std::vector<std::string> keys;
  for (int r = first; r < last; ++r) keys.push_back(member_key(prefix, r));
  if (store.check(keys)) return;
  if (last - first == 1) {
    missing.push_back(first);
    return;
  }
  const int middle = first + (last - first) / 2;
  find_missing(store, prefix, first, middle, missing);
  find_missing(store, prefix, middle, last, missing);
}

}  // namespace

ReachReport exchange_reach(c10d::Store& store, const std::string& prefix, int rank, int size, const std::string& op,
                           const ReachOptions& options) {
  const std::string arrived_key = prefix + "arrived", same_op_key = prefix + "op/" + op;
  store.set(member_key(prefix, rank), bytes_of(op));
  store.add(same_op_key, 1);
  int64_t arrived = store.add(arrived_key, 1);
  // Gone members that have not recorded an arrival (one that left may still fail this collective
  // itself, and record it, later): looked at again on each poll.
  const auto never = [&] {
    int64_t n = 0;
    for (const int r : options.gone) n += store.check({member_key(prefix, r)}) ? 0 : 1;
    return n;
  };
  const auto deadline = std::chrono::steady_clock::now() + options.window;
  while (arrived < size - never() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(options.period);
    arrived = store.add(arrived_key, 0);
  }
  ReachReport report;
  if (arrived < size) find_missing(store, prefix, 0, size, report.missing);
  // Everyone who arrived counted under its own op: fewer under ours means someone issued another.
  if (store.add(same_op_key, 0) < arrived) {
    for (int r = 0; r < size; ++r) {
      const std::string key = member_key(prefix, r);
      if (!store.check({key})) continue;
      const std::vector<uint8_t> theirs = store.get(key);
      const std::string theirs_op(theirs.begin(), theirs.end());
      if (theirs_op != op) report.other_ops.emplace_back(r, theirs_op);
    }
  }
  return report;
}

}  // namespace hp::comm::detail
