#include "hp/nn/token_coordinates.h"

#include <utility>

#include "hp/core/error.h"
#include "hp/core/recompute.h"

namespace hp::nn {
namespace {

thread_local const TokenCoordinates* current = nullptr;

constexpr int64_t kCallsPerStep = int64_t{1} << 16;
constexpr uint64_t kWithoutCoordinates = uint64_t{1} << 63;  // never a step's stream

}  // namespace

const TokenCoordinates* token_coordinates() { return current; }

TokenCoordinatesScope::TokenCoordinatesScope(TokenCoordinates coordinates)
    : coordinates_(std::move(coordinates)), outer_(current) {
  current = &coordinates_;
}

TokenCoordinatesScope::~TokenCoordinatesScope() { current = outer_; }

MicroBatchRows::MicroBatchRows(int64_t offset) {
  if (current == nullptr) return;
  TokenCoordinates narrowed = *current;
  narrowed.first_row += offset;
  scope_.emplace(std::move(narrowed));
}

Draw DrawCounter::next() {
  return replayed<Draw>([&] {
    if (current == nullptr) return Draw{std::nullopt, kWithoutCoordinates | calls_++};
    if (current->step != step_ || current->run != run_)
      calls_at_rows_.clear(), step_ = current->step, run_ = current->run;
    const int64_t call = calls_at_rows_[current->first_row]++;
    HP_CHECK(call < kCallsPerStep, "more than ", kCallsPerStep,
             " random draws of one module at the same rows in one step");
    return Draw{*current, static_cast<uint64_t>(current->step * kCallsPerStep + call)};
  });
}

void DrawCounter::reset() {
  calls_ = 0;
  step_ = -1, run_ = 0;
  calls_at_rows_.clear();
}

}  // namespace hp::nn
