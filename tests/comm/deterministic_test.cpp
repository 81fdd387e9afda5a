// Deterministic mode: sums use one fixed tree order, so results repeat bitwise and equal the same
// tree computed on one rank. Also pins down the tree itself.
#include <hp/comm/process_group.h>
#include <hp/comm/tree_reduce.h>
#include <hp/core/chunking.h>

#include <functional>

#include "test_util.h"

namespace hp::test {
namespace {

using comm::ProcessGroup;
using comm::ReduceOp;

// The tree by its recursive definition: split at the largest power of two below the count.
at::Tensor recursive_tree_sum(const at::Tensor& v, int64_t lo, int64_t hi) {
  if (hi - lo == 1) return v[lo].clone();
  int64_t p = 1;
  while (p * 2 < hi - lo) p *= 2;
  return recursive_tree_sum(v, lo, lo + p) + recursive_tree_sum(v, lo + p, hi);
}

// tree_reduce's level-by-level pairing is the recursive power-of-two tree, bitwise, for 1..9 values.
TEST(TreeReduce, MatchesRecursiveDefinition) {
  for (int64_t n = 1; n <= 9; ++n) {
    at::Tensor v = at::randn({n, 1000}, at::make_generator<at::CPUGeneratorImpl>(n)) * 1e3;
    EXPECT_TRUE(at::equal(comm::tree_reduce(v, ReduceOp::kSum), recursive_tree_sum(v, 0, n))) << "n = " << n;
  }
}

// The tree of 4 is ((v0+v1)+(v2+v3)): two ranks each adding a pair, then adding the pair sums,
// give the same bits (the property later DP-degree invariance builds on).
TEST(TreeReduce, AlignedBlocksAreSubtrees) {
  at::Tensor v = at::randn({8, 257}, at::make_generator<at::CPUGeneratorImpl>(3));
  at::Tensor halves = at::stack(
      {comm::tree_reduce(v.slice(0, 0, 4), ReduceOp::kSum), comm::tree_reduce(v.slice(0, 4, 8), ReduceOp::kSum)});
  EXPECT_TRUE(at::equal(comm::tree_reduce(halves, ReduceOp::kSum), comm::tree_reduce(v, ReduceOp::kSum)));
  EXPECT_TRUE(at::equal(comm::tree_reduce(v, ReduceOp::kAvg), comm::tree_reduce(v, ReduceOp::kSum) / 8));
}

// TreeSum, given one value at a time (micro-batch gradients), is the same tree, bit for bit.
TEST(TreeReduce, TreeSumOfValuesOneAtATimeIsTheTree) {
  for (int64_t n = 1; n <= 9; ++n) {
    const at::Tensor v = at::randn({n, 1000}, at::make_generator<at::CPUGeneratorImpl>(n)) * 1e3;
    comm::TreeSum sum;
    for (int64_t i = 0; i < n; ++i) sum.add(v[i].clone());
    EXPECT_TRUE(at::equal(sum.take(), recursive_tree_sum(v, 0, n))) << "n = " << n;
    EXPECT_TRUE(sum.empty());
  }
  EXPECT_FALSE(comm::TreeSum().take().defined());
}

testing::RunRanksOptions deterministic() {
  testing::RunRanksOptions o;
  o.group.set_deterministic(true);
  return o;
}

// 20 repeated all_reduces of the same random fp32 data give identical bits, equal to the tree
// sum of all ranks' data computed on one rank; also for avg, bf16 and reduce_scatter.
TEST(Deterministic, RepeatedAllReduceIsBitwiseStableAndEqualsLocalTree) {
  for (int world : {2, 3, 4}) {
    run(
        world,
        [&](const ProcessGroup& g) {
          for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
            std::vector<at::Tensor> all;
            for (int r = 0; r < world; ++r) all.push_back(rank_data(r, {1001}, dtype) * 1000);
            const at::Tensor local_tree = comm::tree_reduce(at::stack(all), ReduceOp::kSum);
            at::Tensor first;
            for (int i = 0; i < 20; ++i) {
              at::Tensor result = g.all_reduce(all[g.rank()].clone());
              if (i == 0) first = result;
              check_close(result, first, "repeat " + std::to_string(i), /*bitwise=*/true);
            }
            check_close(first, local_tree, "all_reduce vs one-rank tree " + dtype_name(dtype), true);
            check_close(g.all_reduce(all[g.rank()].clone(), {ReduceOp::kAvg}),
                        comm::tree_reduce(at::stack(all), ReduceOp::kAvg), "avg vs one-rank tree", true);
            const at::Tensor piece = g.reduce_scatter(all[g.rank()]);
            const auto sizes = chunk_sizes(1001, world);
            check_close(piece, local_tree.narrow(0, chunk_offset(1001, world, g.rank()), sizes[g.rank()]),
                        "reduce_scatter vs one-rank tree", true);
          }
        },
        deterministic());
  }
}

// The sum over 4 ranks in deterministic mode differs from a plain sequential sum in general;
// this guards against the test above passing because every order happens to agree.
TEST(Deterministic, TreeOrderIsNotSequentialOrder) {
  at::Tensor v = at::randn({4, 4096}, at::make_generator<at::CPUGeneratorImpl>(11)) * 1e4;
  at::Tensor sequential = ((v[0] + v[1]) + v[2]) + v[3];
  EXPECT_FALSE(at::equal(comm::tree_reduce(v, ReduceOp::kSum), sequential));
}

}  // namespace
}  // namespace hp::test
