// The wait that the shared-memory transport and symmetric memory share (comm/shared_wait.h):
// what it returns when the awaited thing comes, never comes, or can no longer come.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>

#include "comm/shared_wait.h"

namespace hp::test {
namespace {

using comm::detail::deadline_after;
using comm::detail::wait_until;
using comm::detail::WaitOutcome;
using Clock = std::chrono::steady_clock;

// What came just before the other side gave up still counts: arrived() turns true only while
// hopeless() is being asked, and the wait reports it arrived, not that it was hopeless.
TEST(SharedWait, WhatArrivedBeforeTheOtherSideGaveUpCounts) {
  std::atomic<uint32_t> word{0};
  bool came = false;
  const WaitOutcome outcome = wait_until(
      &word, [&] { return came; },
      [&] {
        came = true;
        return true;
      },
      deadline_after(std::chrono::seconds(10)), std::chrono::milliseconds(1));
  EXPECT_EQ(outcome, WaitOutcome::kArrived);
}

TEST(SharedWait, HopelessAndTimedOutWaitsEndAsSuch) {
  std::atomic<uint32_t> word{0};
  EXPECT_EQ(wait_until(
                &word, [] { return false; }, [] { return true; }, deadline_after(std::chrono::seconds(10)),
                std::chrono::milliseconds(1)),
            WaitOutcome::kHopeless);
  const auto start = Clock::now();
  EXPECT_EQ(wait_until(
                &word, [] { return false; }, [] { return false; }, deadline_after(std::chrono::milliseconds(30)),
                std::chrono::milliseconds(50)),
            WaitOutcome::kTimedOut);
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, std::chrono::milliseconds(30));
  EXPECT_LT(waited, std::chrono::seconds(5));  // the last slice is cut to the time left
}

// "Never" (milliseconds::max()) is a deadline far in the future, not one wrapped into the past.
TEST(SharedWait, AnEndlessTimeoutIsFarAway) {
  EXPECT_GT(deadline_after(std::chrono::milliseconds::max()), Clock::now() + std::chrono::hours(24 * 365));
}

}  // namespace
}  // namespace hp::test
