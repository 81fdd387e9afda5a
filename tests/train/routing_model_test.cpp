// A routing model (what a dry run's routers choose) shares a forward's rows out as it says, and
// its spec parses strictly.
#include "hp/train/routing_model.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "scratch_dir.h"
#include "test_util.h"

namespace hp::train {
namespace {

// A routing model shares a forward's rows out as it says, every count within one row per token.
TEST(RoutingModel, SharesOutTheRowsAsItSays) {
  using Counts = std::vector<int64_t>;
  EXPECT_EQ(RoutingModel::balanced().counts("r", 10, 2, 3), (Counts{7, 7, 6}));
  // The hot expert's 90% of 20 rows is over its 10 tokens: it takes 10, the others share the rest.
  EXPECT_EQ(RoutingModel::skewed(0.9).counts("r", 10, 2, 4), (Counts{10, 4, 3, 3}));
  EXPECT_EQ(RoutingModel::skewed(0.4).counts("r", 10, 2, 4), (Counts{8, 4, 4, 4}));
  // A histogram at any scale; experts it gives no load take what the others cannot.
  const RoutingModel h = RoutingModel::histogram({{"a", {0, 0, 1, 1}}, {"b", {30, 10, 0, 0}}});
  EXPECT_EQ(h.counts("a", 10, 3, 4), (Counts{5, 5, 10, 10}));
  EXPECT_EQ(h.counts("b", 10, 1, 4), (Counts{8, 2, 0, 0}));
  EXPECT_EQ(h.str(), "histogram (2 routers)");
  test::expect_error([&] { h.counts("c", 10, 1, 4); }, "the histogram has no loads for router 'c'");
  for (const RoutingModel& m : {RoutingModel::balanced(), RoutingModel::skewed(0.3), RoutingModel::skewed(0.99)})
    for (int64_t tokens : {0, 1, 7, 64, 1000})
      for (int64_t experts : {2, 3, 8, 128})
        for (int64_t top_k : {1, 2, 8}) {
          if (top_k > experts) continue;
          const Counts c = m.counts("r", tokens, top_k, experts);
          int64_t total = 0;
          for (int64_t n : c) {
            EXPECT_GE(n, 0);
            EXPECT_LE(n, tokens) << m.str();
            total += n;
          }
          EXPECT_EQ(total, tokens * top_k) << m.str() << " " << tokens << " " << top_k << " " << experts;
        }
  EXPECT_EQ(RoutingModel::parse("skewed:0.25").str(), "skewed:0.25");
  EXPECT_EQ(RoutingModel::parse("balanced").str(), "balanced");
  for (const char* bad : {"skewed:1.5", "skewed:0"})
    test::expect_error([&] { RoutingModel::parse(bad); }, "skewed needs a hot share in (0, 1)");
  for (const char* bad : {"skewed:", "skewed:0.5x", "skewed:abc", "skewed: 0.5", "skewed:0x1p-1", "skewed:inf"})
    test::expect_error([&] { RoutingModel::parse(bad); }, "skewed:S needs S");
  test::expect_error([] { RoutingModel::parse("zipf"); }, "routing model 'zipf' is unknown");
  test::expect_error([] { RoutingModel::parse("histogram:/no/such/file"); }, "cannot read the histogram file");
  test::expect_error([] { RoutingModel::parse("histogram:"); }, "histogram:FILE needs the file");
  const std::string file = test::scratch_dir("routing_model") + "/loads.json";
  std::ofstream(file) << R"({"layers.0.mlp.router": [1, "two"]})";
  test::expect_error([&] { RoutingModel::parse("histogram:" + file); }, "must be an array of numbers");
  std::ofstream(file) << R"({"layers.0.mlp.router": [3, 1]} trailing)";
  test::expect_error([&] { RoutingModel::parse("histogram:" + file); }, "is not JSON");
  std::ofstream(file) << R"({"layers.0.mlp.router": [3, 1]})";
  EXPECT_EQ(RoutingModel::parse("histogram:" + file).counts("layers.0.mlp.router", 8, 1, 2), (Counts{6, 2}));
  test::expect_error([] { RoutingModel::histogram({{"a", {1, -1}}}); }, "must be finite numbers >= 0");
  // Loads at any scale, their sum beyond a double's range included.
  EXPECT_EQ(RoutingModel::histogram({{"a", {1e308, 1e308, 0}}}).counts("a", 10, 1, 3), (Counts{5, 5, 0}));
}

}  // namespace
}  // namespace hp::train
