// Last words after an error (docs/resilience.md#last-words-after-an-error): when training ends
// with an error on one rank, every rank learns whose error it was, and the ranks agree, through the
// store alone (their collectives may be broken), on the step whose state all of them hold whole,
// to save it.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>

#include "hp/comm/process_group.h"
#include "hp/dtensor/random.h"

namespace hp::train::detail {

// What this rank's parameters and optimizer state hold when its training ends with an error: a
// step's whole state and the mesh's RNG position that goes with it, or nothing (no step) while the
// optimizer step, or the model's hook before it, is changing them.
struct HeldState {
  std::optional<int64_t> step;
  MeshRngState rng;
};

struct ErrorAccount {
  // The first rank whose own error (not a failed collective) ended training, where, and the
  // error's first line: "world rank 2, in step 8: injected fault: ...". Empty when no rank raised
  // one: this rank's collective failed because a rank died or hangs.
  std::string origin;
  bool own_error = false;  // this rank's error is its own, not a failed collective's
  // The step every rank holds whole, when a save was asked for and every rank reported it.
  std::optional<int64_t> step;
  std::string why_not;  // otherwise (with a save asked for and an origin), why there is none
};

class ErrorAccounting {
 public:
  // At the start of train(), on every rank (collective: a broadcast from rank 0): each run on a
  // world keeps its own keys in the store, and counts only the collectives that fail during it.
  explicit ErrorAccounting(comm::ProcessGroup world);

  // Every rank whose training ends with `error` calls it (`where`: "in step 8"). A rank whose error
  // is its own publishes it; a rank whose collective failed looks for such an error for up to 3 s
  // (ranks that fail together, as a pipeline's do, may look before the origin has published) and,
  // when no rank published one, returns with an empty origin. Otherwise the rank leaves its groups,
  // so that peers still waiting for it in a collective fail at once, and, with `save`, reports what
  // it holds. The first rank to publish waits for every rank's report up to the world's timeout + 5
  // s + `slack` (a rank on Gloo learns of the error only when its collective times out, which it may
  // have entered up to a step later) and decides for all: the step, when every rank reports the same
  // whole step, or why not. Store requests: a few per rank, one per 20 ms of waiting, and one per
  // rank read once when the reports disagree or some never come.
  // `rank_lost`, when given, says early that no rank will publish (a rank's process died, and hprun
  // is starting it again): the look for an error ends then.
  ErrorAccount account(const std::exception& error, const std::string& where, const HeldState& held, bool save,
                       std::chrono::milliseconds slack, const std::function<bool()>& rank_lost = {}) const;

 private:
  std::string key(const std::string& name) const { return prefix_ + name; }
  std::string missing(std::chrono::milliseconds waited) const;
  std::string disagreement() const;
  comm::ProcessGroup world_;
  std::string prefix_;
  uint64_t failures_before_;
};

}  // namespace hp::train::detail
