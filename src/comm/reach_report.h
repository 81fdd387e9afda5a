// After a collective fails, its members find out through the group's store which of them reached
// it, and which issued a different collective in its place (a program-order bug), to name them in
// the error. Each member records its arrival and then waits for the others for a short window.
//
// What it costs the store, per member: three requests to record, one per poll period while waiting
// (a shared arrival counter, not every member's key), and at the end about m log2(size) requests
// to name m missing members (halving a set of keys checked in one request). So a failure at 4,096
// ranks costs each member about what it costs at 8. Only a program-order bug, where someone's
// collective differs, reads every member's record once.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "comm/c10d_shim.h"

namespace hp::comm::detail {

struct ReachReport {
  std::vector<int> missing;                            // group ranks that never recorded an arrival
  std::vector<std::pair<int, std::string>> other_ops;  // (group rank, the collective it issued instead)
};

struct ReachOptions {
  std::chrono::milliseconds window{2000};  // how long to wait for the others
  std::chrono::milliseconds period{20};    // between two looks at the arrival counter
  // Members known to be gone (their process exited, or they left the group): the wait ends once
  // every other member arrived. One that recorded its arrival (before it went, or failing this
  // collective after it left) counts as arrived; the others are named among the missing.
  std::vector<int> gone;
};

// `prefix` names the collective ("hp_reached/<seq>/"); every member of a group of `size` calls it
// with its own `rank` and the collective `op` it issued. Throws what the store throws.
ReachReport exchange_reach(c10d::Store& store, const std::string& prefix, int rank, int size, const std::string& op,
                           const ReachOptions& options);

}  // namespace hp::comm::detail
