// What a pipeline's failure notice (pp/failure_notice.h) costs the job's store: every rank of a
// pass looks at one key per period, so the requests per rank per second stay flat as the world
// grows, healthy or failing; and a published failure reaches every rank promptly. At 8, 64 and 256
// ranks, each a notice of its own on a thread, over one counting in-process store.
#include <gtest/gtest.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "comm/counting_store.h"
#include "comm/group_impl.h"
#include "pp/failure_notice.h"

namespace hp::pp {
namespace {

// `size` members of one group whose store is `store` (no transport: a notice only uses the store).
std::vector<comm::ProcessGroup> groups_on(const c10::intrusive_ptr<test::CountingStore>& store, int size) {
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  std::vector<comm::ProcessGroup> groups;
  for (int r = 0; r < size; ++r) {
    auto impl = std::make_shared<comm::detail::GroupImpl>();
    impl->store = store;
    impl->name = "pipeline";
    impl->ranks = ranks;
    impl->rank = r;
    impl->fake = true;
    groups.emplace_back(std::move(impl));
  }
  return groups;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Guards the store's load: seen to fail (449 and 3,220 requests per rank per second at 8 and 64
// ranks) with each notice also looking at one key per member of the group.
TEST(FailureNotice, StoreRequestsPerRankPerSecondStayFlatAsTheWorldGrows) {
  std::vector<double> healthy;
  for (const int size : {8, 64, 256}) {
    auto store = c10::make_intrusive<test::CountingStore>();
    const std::vector<comm::ProcessGroup> groups = groups_on(store, size);
    {  // a healthy pass: every rank polls until the pass ends
      std::vector<std::unique_ptr<FailureNotice>> notices;
      const auto start = std::chrono::steady_clock::now();
      for (const comm::ProcessGroup& g : groups) notices.push_back(std::make_unique<FailureNotice>(g, "pass/1/failed"));
      std::this_thread::sleep_for(std::chrono::seconds(1));
      for (auto& notice : notices) notice->stop();
      healthy.push_back(static_cast<double>(store->requests) / size / seconds_since(start));
    }
    {  // a failing pass: the last rank publishes; every other rank sees it
      std::vector<std::unique_ptr<FailureNotice>> notices;
      for (const comm::ProcessGroup& g : groups) notices.push_back(std::make_unique<FailureNotice>(g, "pass/2/failed"));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      // The window counted is never wider than `took`.
      const auto start = std::chrono::steady_clock::now();
      const int64_t before = store->requests;
      notices.back()->publish("rank failed");
      for (int r = 0; r + 1 < size; ++r)
        while (!notices[r]->failed() && seconds_since(start) < 10.0)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      const double requests = static_cast<double>(store->requests - before) / size;
      const double took = seconds_since(start);
      for (auto& notice : notices) notice->stop();
      for (int r = 0; r + 1 < size; ++r) EXPECT_TRUE(notices[r]->failed()) << size << " ranks: rank " << r;
      // One look per period elapsed, and the one that finds the notice (the publisher: its set).
      EXPECT_LE(requests, took / 0.020 + 2.0) << size << " ranks";
      std::cout << size << " ranks: " << healthy.back() << " store requests per rank per second in a healthy pass; "
                << "a published failure seen by all in " << 1e3 * took << " ms, " << requests
                << " requests per rank meanwhile\n";
      EXPECT_LT(took, 2.0) << size << " ranks";
    }
  }
  // One look per 20 ms: 50 a second, however many ranks (a loaded machine only looks less often).
  for (double rate : healthy) EXPECT_LE(rate, 55.0);
}

}  // namespace
}  // namespace hp::pp
