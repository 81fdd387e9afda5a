// What a dry run's peak is made of: the allocations of a MemoryTimeline alive at the step's
// largest total, by category and by the module (block) that made them, and their lifetimes as CSV.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "hp/core/memory_timeline.h"

namespace hp::train::detail {

// The categories a peak is split into, in the order of DryRunReport::peak_by_category's docs.
inline constexpr const char* kParameters = "parameters";
inline constexpr const char* kGradients = "gradients";
inline constexpr const char* kOptimizerState = "optimizer state";
inline constexpr const char* kActivations = "activations";
inline constexpr const char* kCommunicationBuffers = "communication buffers";
inline constexpr const char* kTemporaries = "temporaries";

struct PeakBreakdown {
  int64_t bytes = 0;                           // the largest total during the step (what the categories add up to)
  std::map<std::string, int64_t> by_category;  // every category, 0 where none
  std::vector<std::pair<std::string, int64_t>> top;  // largest first
};

struct TimelineNames {
  // Allocations that are a parameter, a gradient or optimizer state (kParameters, ...), by id.
  std::unordered_map<int64_t, std::string> held;
  // Modules by address, named by FQN.
  std::unordered_map<const void*, std::string> modules;
};

// The allocations alive at the largest total between events `from` and `to` of `timeline`
// (`allocations`, `events`): "parameters", "gradients" and "optimizer state" as `names.held` says,
// then "activations" (made inside a module's call; the top list names its block: "layers.3"),
// "communication buffers" (made inside a collective) and "temporaries" (the rest). `top` at most.
PeakBreakdown break_down_peak(const std::vector<MemoryTimeline::Allocation>& allocations, int64_t events, int64_t from,
                              int64_t to, const TimelineNames& names, size_t top);

// One row per allocation alive at some point between events `from` and `to`: id, bytes, category,
// block, and the events (relative to `from`) it was made and freed at (empty while it lives).
std::string lifetimes_csv(const std::vector<MemoryTimeline::Allocation>& allocations, int64_t from, int64_t to,
                          const TimelineNames& names);

}  // namespace hp::train::detail
