// Failures are errors with names, never hangs: missing peers, dead peers, bad arguments, and the
// harness's own reporting (failing rank named, watchdog).
#include <hp/comm/process_group.h>
#include <hp/core/error.h>

#include <chrono>
#include <thread>

#include "test_util.h"

namespace hp::test {
namespace {

using comm::ProcessGroup;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// A peer that is alive but never calls the collective: the others get hp::TimeoutError naming
// the collective, the group and the missing rank, shortly after the group timeout.
TEST(Failures, MissingPeerIsATimeoutNamingIt) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::milliseconds(1000));
  options.barrier_at_exit = false;  // rank 2 never takes part
  run(
      3,
      [](const ProcessGroup& g) {
        if (g.rank() == 2) {
          std::this_thread::sleep_for(std::chrono::milliseconds(9000));  // never arrives, then leaves
          return;
        }
        const auto start = Clock::now();
        expect_error<TimeoutError>([&] { g.all_reduce(at::ones({8})); },
                                   {"all_reduce", "group 'world'", "timeout of 1000 ms", "never reached it", "[2]"});
        const double took = seconds_since(start);  // 1 s timeout + up to 2 s asking who is missing, plus load
        if (took > 8.0) throw std::runtime_error("timeout took " + std::to_string(took) + " s");
      },
      options);
}

// A peer whose process group is gone (its rank failed): the survivor fails with an error
// naming the dead rank, well before its own (long) timeout.
TEST(Failures, DeadPeerFailsPromptly) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(30));
  options.barrier_at_exit = false;
  double survivor_seconds = -1;
  std::string survivor_error;
  try {
    testing::run_ranks(
        2,
        [&](const ProcessGroup& g) {
          g.barrier();  // both alive and connected
          if (g.rank() == 1) throw std::runtime_error("rank 1 dies");
          const auto start = Clock::now();
          try {
            g.all_reduce(at::ones({1024}));
          } catch (const Error& e) {
            survivor_seconds = seconds_since(start);
            survivor_error = e.what();
          }
        },
        options);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1: rank 1 dies"), std::string::npos) << e.what();
  }
  ASSERT_GE(survivor_seconds, 0) << "the survivor's all_reduce did not fail";
  EXPECT_LT(survivor_seconds, 10.0);
  EXPECT_NE(survivor_error.find("all_reduce on group 'world'"), std::string::npos) << survivor_error;
  EXPECT_NE(survivor_error.find("[1]"), std::string::npos) << survivor_error;
}

// run_ranks names every rank that threw, and what it threw.
TEST(Harness, NamesTheFailingRank) {
  testing::RunRanksOptions options;
  options.barrier_at_exit = false;  // only rank 2's own failure is reported
  try {
    testing::run_ranks(
        3,
        [](const ProcessGroup& g) {
          if (g.rank() == 2) throw std::runtime_error("boom on two");
        },
        options);
    FAIL() << "run_ranks did not report the failure";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2: boom on two"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1 of 3 ranks failed"), std::string::npos) << e.what();
  }
}

// The watchdog turns a hung rank into hp::TimeoutError naming it, within its bound.
TEST(Harness, WatchdogFailsAHungTest) {
  testing::RunRanksOptions options;
  options.watchdog = std::chrono::milliseconds(500);
  options.barrier_at_exit = false;
  const auto start = Clock::now();
  try {
    testing::run_ranks(
        2,
        [](const ProcessGroup& g) {
          if (g.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(4));
        },
        options);
    FAIL() << "the watchdog did not fire";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("ranks still running: 1"), std::string::npos) << e.what();
  }
  EXPECT_LT(seconds_since(start), 3.0);                          // well before the hung rank's 4 s
  std::this_thread::sleep_for(std::chrono::milliseconds(4500));  // let the detached rank finish cleanly
}

// Bad arguments are hp::Errors that say what would be valid; nothing is sent.
TEST(Failures, BadArgumentsAreClearErrors) {
  run(2, [](const ProcessGroup& g) {
    expect_error(
        [&] {
          g.all_gather(at::ones({2}), {0, {2, 2, 2}});
        },
        {"all_gather", "sizes has 3 entries", "2 ranks"});
    expect_error([&] { g.all_gather(at::ones({2}), {0, {3, 3}}); }, {"all_gather", "sizes[", "has size 2"});
    expect_error([&] { g.all_gather(at::ones({2}), {3}); }, {"all_gather", "dim 3 is out of range"});
    expect_error(
        [&] {
          g.reduce_scatter(at::ones({4}), {comm::ReduceOp::kSum, 0, {1, 2}});
        },
        {"reduce_scatter", "add up to 3", "size 4"});
    expect_error([&] { g.all_gather_into_tensor(at::empty({3}), at::ones({2})); },
                 {"all_gather_into_tensor", "output is [3]", "gathered tensor is [4]"});
    expect_error([&] { g.reduce_scatter_tensor(at::empty({2}, at::kLong), at::ones({4})); },
                 {"reduce_scatter_tensor", "output is [2] Long", "piece is [2] Float"});
    expect_error([&] { g.all_to_all(at::ones({3})); }, {"all_to_all", "does not split evenly", "pass split sizes"});
    expect_error([&] { g.all_to_all(at::ones({2}), {{1, 1}, {}}); }, {"all_to_all", "give both"});
    expect_error([&] { g.all_reduce(at::ones({2}, at::kLong), {comm::ReduceOp::kAvg}); },
                 {"all_reduce", "avg needs a floating-point dtype"});
    expect_error([&] { g.broadcast(at::ones({2}), 5); }, {"broadcast", "root 5"});
    expect_error([&] { g.send(at::ones({2}), g.rank()); }, {"send", "must be another rank"});
    expect_error([&] { g.new_group({0, 0}); }, {"new_group", "duplicate"});
    expect_error([&] { g.new_group({7}); }, {"new_group", "must lie in [0, 2)"});
    expect_error([&] { g.new_group({1 - g.rank()}); }, {"new_group", "only members create a group"});
    g.barrier();  // both ranks are still in step after all of that
  });
}

}  // namespace
}  // namespace hp::test
