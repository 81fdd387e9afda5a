// lead_first: the others wait for rank 0's start-up work as long as it takes (not the collective
// timeout), learn of its failure at once, and each call waits for its own work.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "hp/testing/run_ranks.h"
#include "test_util.h"
#include "train/lead_first.h"

namespace hp::train::detail {
namespace {

using std::chrono::milliseconds;

testing::RunRanksOptions one_second_timeout() {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(1));
  return options;
}

// Guards the reason it exists: a barrier here failed after the collective timeout (1 s) while
// rank 0 was still preparing (2 s).
TEST(LeadFirst, TheOthersWaitLongerThanTheCollectiveTimeout) {
  test::run(
      3,
      [](const comm::ProcessGroup& world) {
        const auto start = std::chrono::steady_clock::now();
        lead_first(world, "preparing", [] { std::this_thread::sleep_for(milliseconds(2000)); });
        EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(1900)) << "rank " << world.rank();
      },
      one_second_timeout());
}

// Guards the per-call key: were the second call's waiters to take the first call's "ok" for theirs,
// they would wait in the closing barrier, and time out there (1 s) while rank 0 works (1.5 s).
TEST(LeadFirst, EachCallWaitsForItsOwnWork) {
  test::run(
      2,
      [](const comm::ProcessGroup& world) {
        lead_first(world, "twice", [] {});
        lead_first(world, "twice", [] { std::this_thread::sleep_for(milliseconds(1500)); });
      },
      one_second_timeout());
}

TEST(LeadFirst, Rank0sFailureReachesTheOthersAtOnce) {
  test::run(
      2,
      [](const comm::ProcessGroup& world) {
        const auto start = std::chrono::steady_clock::now();
        test::expect_error(
            [&] { lead_first(world, "preparing the data", [] { HP_FAIL("no such file x.txt"); }); },
            world.rank() == 0 ? "no such file x.txt" : "rank 0 failed preparing the data: no such file x.txt");
        EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(900));
      },
      [] {
        testing::RunRanksOptions options = one_second_timeout();
        options.barrier_at_exit = false;
        return options;
      }());
}

}  // namespace
}  // namespace hp::train::detail
