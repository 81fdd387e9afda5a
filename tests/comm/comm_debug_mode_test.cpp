// CommDebugMode counts exactly the collectives this thread issues, composed ones once.
#include <hp/comm/comm_debug_mode.h>
#include <hp/comm/process_group.h>

#include "test_util.h"

namespace hp::test {
namespace {

TEST(CommDebugMode, CountsEachCollectiveOnceAndNests) {
  run(2, [](const comm::ProcessGroup& g) {
    const at::Tensor x = at::ones({4, 3});
    comm::CommDebugMode outer;
    g.all_reduce(x.clone());
    {
      comm::CommDebugMode inner;
      g.all_gather(x);
      g.reduce_scatter(x);  // composed from all_to_all + tree reduction on Gloo: still one
      g.all_reduce_async(x.clone(), {comm::ReduceOp::kAvg}).wait();
      EXPECT_EQ(inner.count("all_gather"), 1);
      EXPECT_EQ(inner.count("reduce_scatter"), 1);
      EXPECT_EQ(inner.count("all_reduce"), 1);
      EXPECT_EQ(inner.count("all_to_all"), 0);
      EXPECT_EQ(inner.total(), 3);
      EXPECT_EQ(inner.bytes("all_gather"), 4 * 3 * 4);  // what this rank put in
      EXPECT_EQ(inner.total_bytes(), 3 * 4 * 3 * 4);
      EXPECT_EQ(inner.str(), "all_gather x1 (48 B), all_reduce x1 (48 B), reduce_scatter x1 (48 B)");
    }
    EXPECT_EQ(outer.count("all_reduce"), 2);
    EXPECT_EQ(outer.total(), 4);
  });
}

TEST(CommDebugMode, OtherThreadsAndSingleRankGroupsAreNotCounted) {
  comm::CommDebugMode mode;
  run(1, [](const comm::ProcessGroup& g) { g.all_reduce(at::ones({2})); });  // other thread, one rank
  EXPECT_EQ(mode.total(), 0);
  run(1, [](const comm::ProcessGroup& g) {
    comm::CommDebugMode here;
    g.all_reduce(at::ones({2}));
    EXPECT_EQ(here.total(), 0);  // a group of one rank moves nothing
  });
}

}  // namespace
}  // namespace hp::test
