// Where a forward runs with respect to activation checkpointing (hp/parallel/checkpoint.h), for the
// code inside a checkpointed region that must behave the same both times it runs.
//
// A checkpointed region's forward runs twice: when the model runs (the first pass: its activations
// are dropped) and again in backward (the recomputation, which rebuilds them). Two kinds of code
// care:
//  - counters of training forwards (MoE token counts, auxiliary losses) count the first pass only:
//    `!recomputing()`;
//  - draws that must come out the same (a dropout's mask stream, the distributed RNG's stream, MoE
//    routing decisions) go through `replayed`: the first pass records what it drew, the
//    recomputation gets the same values back, in the same order, without drawing.
//
//   uint64_t stream = hp::replayed<uint64_t>([&] { return calls_++; });
#pragma once

#include <any>
#include <cstddef>
#include <functional>
#include <string>
#include <typeinfo>
#include <vector>

namespace hp {

enum class ForwardPass {
  kPlain,      // not in a checkpointed region
  kFirst,      // a checkpointed region's first pass
  kRecompute,  // its recomputation in backward
};

// The values one region's first pass drew, in order.
class RecomputeRecord {
 public:
  explicit RecomputeRecord(std::string region) : region_(std::move(region)) {}
  void put(std::any value) { values_.push_back(std::move(value)); }
  // The next value in put order, which must be a T; the recomputation asks for what the first pass
  // recorded, or it would not be the same computation (an error naming the region).
  const std::any& take(const std::type_info& type);
  void rewind() { next_ = 0; }
  // All values taken since the last rewind: the recomputation drew what the first pass drew.
  void check_all_taken() const;
  const std::string& region() const { return region_; }
  size_t size() const { return values_.size(); }

 private:
  std::string region_;
  std::vector<std::any> values_;
  size_t next_ = 0;
};

// This thread's pass, and the record of the region it is in (null in kPlain).
ForwardPass forward_pass();
RecomputeRecord* recompute_record();
inline bool recomputing() { return forward_pass() == ForwardPass::kRecompute; }

// Sets this thread's pass and record for the scope (the checkpoint plan does this).
class ForwardPassScope {
 public:
  ForwardPassScope(ForwardPass pass, RecomputeRecord* record);
  ~ForwardPassScope();
  ForwardPassScope(const ForwardPassScope&) = delete;
  ForwardPassScope& operator=(const ForwardPassScope&) = delete;

 private:
  ForwardPass pass_;
  RecomputeRecord* record_;
};

// Marks the ops run in its scope as machinery around a region's computation, not part of it: code
// that runs differently in a first pass and a recomputation (FSDP's gathers and releases, the draws
// that `replayed` skips when recomputing). Selective checkpointing neither counts nor saves them, so
// that the ops it does index line up in both passes; other dispatch modes still see them.
class NotRegionComputation {
 public:
  NotRegionComputation();
  ~NotRegionComputation();
  NotRegionComputation(const NotRegionComputation&) = delete;
  NotRegionComputation& operator=(const NotRegionComputation&) = delete;
  static bool active();  // on this thread
};

// draw() outside checkpointed regions; in a first pass, draw() recorded; in a recomputation, what
// the first pass recorded at this point (draw is not called).
template <typename T, typename Draw>
T replayed(Draw&& draw) {
  RecomputeRecord* record = recompute_record();
  if (record == nullptr) return draw();
  if (forward_pass() == ForwardPass::kRecompute) return std::any_cast<T>(record->take(typeid(T)));
  const NotRegionComputation skipped_when_recomputing;
  T value = draw();
  record->put(value);
  return value;
}

}  // namespace hp
