// Placements, DTensorSpec's local shapes (torch.chunk semantics, nested sharding) and the
// redistribute planner's choice of steps.
#include <hp/core/error.h>
#include <hp/dtensor/redistribute.h>
#include <hp/dtensor/spec.h>

#include "test_util.h"

namespace hp::test {
namespace {

using Kind = RedistributeStep::Kind;

// Placements print like PyTorch's and compare by value.
TEST(Placement, ValuesPrintAndCompare) {
  EXPECT_EQ(Shard(1).str(), "S(1)");
  EXPECT_EQ(Replicate().str(), "R");
  EXPECT_EQ(Partial().str(), "P(sum)");
  EXPECT_EQ(Partial(comm::ReduceOp::kMax).str(), "P(max)");
  EXPECT_EQ(to_string({Shard(0), Replicate()}), "[S(0), R]");
  EXPECT_EQ(Shard(0), Shard(0));
  EXPECT_NE(Shard(0), Shard(1));
  EXPECT_NE(Partial(), Partial(comm::ReduceOp::kAvg));
  EXPECT_EQ(std::hash<Placement>()(Shard(2)), std::hash<Placement>()(Shard(2)));
  EXPECT_THROW(Replicate().dim(), Error);
}

// Local shapes and offsets follow torch.chunk, nested in mesh-dim order: 7 rows over (2, 2) with
// [S(0), S(0)] are split 4 | 3, then 2 | 2 and 2 | 1.
TEST(DTensorSpec, LocalShapesFollowChunkNestedInMeshOrder) {
  run(4, [](const comm::ProcessGroup& world) {
    DeviceMesh mesh = init_device_mesh(world, "cpu", {2, 2}, {"dp", "tp"});
    DTensorSpec nested(mesh, {Shard(0), Shard(0)}, {7, 5});
    const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> want = {
        {{2, 5}, {0, 0}}, {{2, 5}, {2, 0}}, {{2, 5}, {4, 0}}, {{1, 5}, {6, 0}}};
    for (int64_t c0 = 0; c0 < 2; ++c0)
      for (int64_t c1 = 0; c1 < 2; ++c1)
        if (nested.local_shape_and_offset({c0, c1}) != want[c0 * 2 + c1])
          throw std::runtime_error("nested local shape at (" + std::to_string(c0) + ", " + std::to_string(c1) + ")");
    DTensorSpec cols(mesh, {Replicate(), Shard(-1)}, {7, 5});  // negative dims are normalized
    if (cols.placements()[1] != Shard(1)) throw std::runtime_error("Shard(-1) was not normalized");
    if (cols.local_shape_and_offset({0, 1}).first != std::vector<int64_t>{7, 2})
      throw std::runtime_error("S(1) of 5 over 2: second piece should have 2 columns");
    // Errors name the problem.
    try {
      DTensorSpec(mesh, {Shard(0)}, {7, 5});
      throw std::runtime_error("one placement for a 2-D mesh was accepted");
    } catch (const Error& e) {
      if (std::string(e.what()).find("1 placements [S(0)] for a 2-D mesh") == std::string::npos) throw;
    }
    try {
      DTensorSpec(mesh, {Shard(2), Replicate()}, {7, 5});
      throw std::runtime_error("S(2) of a 2-D tensor was accepted");
    } catch (const Error& e) {
      if (std::string(e.what()).find("S(2) is out of range") == std::string::npos) throw;
    }
  });
}

std::vector<Kind> kinds(const Placements& src, const Placements& dst) {
  std::vector<Kind> out;
  for (const auto& s : plan_redistribute(src, dst)) out.push_back(s.kind);
  return out;
}

// The planner picks the single cheapest collective for each one-dim change.
TEST(RedistributePlan, OneStepTransitions) {
  EXPECT_EQ(kinds({Shard(0)}, {Replicate()}), std::vector<Kind>{Kind::kAllGather});
  EXPECT_EQ(kinds({Replicate()}, {Shard(1)}), std::vector<Kind>{Kind::kChunk});
  EXPECT_EQ(kinds({Partial()}, {Replicate()}), std::vector<Kind>{Kind::kAllReduce});
  EXPECT_EQ(kinds({Partial()}, {Shard(0)}), std::vector<Kind>{Kind::kReduceScatter});
  EXPECT_EQ(kinds({Shard(0)}, {Shard(1)}), std::vector<Kind>{Kind::kAllToAll});
  EXPECT_EQ(kinds({Replicate()}, {Partial()}), std::vector<Kind>{Kind::kPartition});
  EXPECT_EQ(kinds({Shard(0)}, {Partial()}), (std::vector<Kind>{Kind::kAllGather, Kind::kPartition}));
  EXPECT_TRUE(kinds({Shard(0), Replicate()}, {Shard(0), Replicate()}).empty());
}

// Nested sharding: inner splits are undone (last mesh dim first) before an outer one changes.
TEST(RedistributePlan, NestedShardsUnshardInnerFirst) {
  const auto plan = plan_redistribute({Shard(0), Shard(0)}, {Replicate(), Shard(0)});
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[0], (RedistributeStep{Kind::kAllGather, 1, Shard(0), Replicate()}));
  EXPECT_EQ(plan[1], (RedistributeStep{Kind::kAllGather, 0, Shard(0), Replicate()}));
  EXPECT_EQ(plan[2], (RedistributeStep{Kind::kChunk, 1, Replicate(), Shard(0)}));
  // Changing only the inner split needs no outer step.
  EXPECT_EQ(kinds({Shard(0), Shard(0)}, {Shard(0), Replicate()}), std::vector<Kind>{Kind::kAllGather});
  // S(0)->S(1) next to another S(1) is not a plain all_to_all.
  EXPECT_EQ(kinds({Shard(0), Shard(1)}, {Shard(1), Shard(1)}),
            (std::vector<Kind>{Kind::kAllGather, Kind::kAllGather, Kind::kChunk, Kind::kChunk}));
}

// Transitions with no plan are errors naming both placement lists.
TEST(RedistributePlan, PartialToOtherPartialIsAnError) {
  try {
    plan_redistribute({Partial()}, {Partial(comm::ReduceOp::kMax)});
    FAIL() << "P(sum) -> P(max) was planned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no plan for P(sum) -> P(max)"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace hp::test
