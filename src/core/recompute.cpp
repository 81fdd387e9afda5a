#include "hp/core/recompute.h"

#include "hp/core/error.h"

namespace hp {
namespace {
thread_local ForwardPass current_pass = ForwardPass::kPlain;
thread_local RecomputeRecord* current_record = nullptr;
thread_local int machinery_depth = 0;
}  // namespace

NotRegionComputation::NotRegionComputation() { ++machinery_depth; }
NotRegionComputation::~NotRegionComputation() { --machinery_depth; }
bool NotRegionComputation::active() { return machinery_depth > 0; }

const std::any& RecomputeRecord::take(const std::type_info& type) {
  HP_CHECK(next_ < values_.size(), "activation checkpointing: the recomputation of ", region_,
           " drew more values than its forward (", values_.size(),
           "); the region's forward must run the same way both times");
  const std::any& value = values_[next_];
  HP_CHECK(value.type() == type, "activation checkpointing: the recomputation of ", region_, " drew value ", next_,
           " as a different kind than its forward did; the region's forward must run the same way both times");
  ++next_;
  return value;
}

void RecomputeRecord::check_all_taken() const {
  HP_CHECK(next_ == values_.size(), "activation checkpointing: the recomputation of ", region_, " drew ", next_,
           " values where its forward drew ", values_.size(),
           "; the region's forward must run the same way both times");
}

ForwardPass forward_pass() { return current_pass; }
RecomputeRecord* recompute_record() { return current_record; }

ForwardPassScope::ForwardPassScope(ForwardPass pass, RecomputeRecord* record)
    : pass_(current_pass), record_(current_record) {
  current_pass = pass;
  current_record = record;
}

ForwardPassScope::~ForwardPassScope() {
  current_pass = pass_;
  current_record = record_;
}

}  // namespace hp
