// hp::nn::Dropout with token coordinates: element (row, position, feature) of the global batch
// keeps or drops by its global index, so a rank's rows, a micro-batch, a context-parallel shard and
// a DTensor piece each get exactly their part of the one-device mask; recomputation replays it.
#include <hp/dtensor/dtensor.h>
#include <hp/nn/attention.h>
#include <hp/nn/layers.h>
#include <hp/nn/token_coordinates.h>
#include <hp/parallel/checkpoint.h>

#include "test_util.h"

namespace hp::test {
namespace {

constexpr double kP = 0.3;

nn::TokenCoordinates at_step(int64_t step, int64_t first_row = 0, int64_t global_rows = 4, int64_t global_seq = 8) {
  nn::TokenCoordinates c;
  c.step = step, c.first_row = first_row, c.global_rows = global_rows, c.global_seq = global_seq;
  return c;
}

// A fresh module each time, so that every draw below is its module's first at its rows.
at::Tensor dropped(const at::Tensor& x, const nn::TokenCoordinates& where, uint64_t seed = 11) {
  nn::Dropout dropout(kP);
  dropout.seed(seed);
  const nn::TokenCoordinatesScope scope(where);
  return dropout(x);
}

// The one-device mask of a [4 rows, 8 tokens, 6 features] batch at step 5.
at::Tensor whole_batch_mask() { return dropped(at::ones({4, 8, 6}), at_step(5)); }

TEST(Dropout, RowsMicroBatchesAndContextShardsGetTheirPartOfTheMask) {
  const at::Tensor whole = whole_batch_mask();
  const double kept = 1.0 / (1.0 - kP);
  EXPECT_TRUE(at::logical_or(whole == 0.0, whole == static_cast<float>(kept)).all().item<bool>());
  // A data-parallel rank's rows.
  check_close(dropped(at::ones({2, 8, 6}), at_step(5, 2)), whole.narrow(0, 2, 2), "rows 2..3", /*bitwise=*/true);
  // Micro-batches of a call: one module, both halves, in either order.
  {
    nn::Dropout dropout(kP);
    dropout.seed(11);
    const nn::TokenCoordinatesScope scope(at_step(5));
    at::Tensor second, first;
    {
      const nn::MicroBatchRows rows(2);
      second = dropout(at::ones({2, 8, 6}));
    }
    {
      const nn::MicroBatchRows rows(0);
      first = dropout(at::ones({2, 8, 6}));
    }
    check_close(at::cat({first, second}), whole, "two micro-batches", true);
  }
  // A context-parallel shard: positions 0, 1, 6, 7 (the head-tail cut of 8 tokens over 2 ranks).
  nn::TokenCoordinates shard = at_step(5);
  shard.positions = at::tensor({0, 1, 6, 7}, at::kLong);
  check_close(dropped(at::ones({4, 4, 6}), shard), whole.index_select(1, shard.positions), "positions 0, 1, 6, 7",
              true);
}

TEST(Dropout, StepsCallsAndSeedsDrawFreshMasks) {
  const at::Tensor whole = whole_batch_mask();
  EXPECT_FALSE(at::equal(dropped(at::ones({4, 8, 6}), at_step(6)), whole)) << "another step";
  EXPECT_FALSE(at::equal(dropped(at::ones({4, 8, 6}), at_step(5), 12), whole)) << "another seed";
  nn::Dropout dropout(kP);
  dropout.seed(11);
  const nn::TokenCoordinatesScope scope(at_step(5));
  check_close(dropout(at::ones({4, 8, 6})), whole, "first call", true);
  EXPECT_FALSE(at::equal(dropout(at::ones({4, 8, 6})), whole)) << "a second call at the same rows";
  // About 1 - p of a large batch is kept.
  const double fraction =
      (dropped(at::ones({64, 64, 16}), at_step(1, 0, 64, 64)) != 0.0).to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(fraction, 1.0 - kP, 0.01);
}

TEST(Dropout, CoordinatesThatDoNotFitAreErrors) {
  expect_error([] { dropped(at::ones({2, 8, 6}), at_step(5, 3)); }, "are not rows of the global batch of 4");
  nn::TokenCoordinates shard = at_step(5);
  shard.positions = at::tensor({0, 1, 6, 7}, at::kLong);
  expect_error(
      [&] {
        dropped(at::ones({4, 5, 6}), shard);
      },
      "the input has 5 tokens per row where the token coordinates place 4");
  expect_error(
      [] {
        dropped(at::ones({4, 4, 6}), at_step(5));
      },
      "the input has 4 tokens per row where the token coordinates place 8");
  shard.positions = at::tensor({0, 1, 8, 9}, at::kLong);
  expect_error([&] { dropped(at::ones({4, 4, 6}), shard); }, "outside rows of 8 tokens");
  expect_error([] { dropped(at::ones({4}), at_step(5)); }, "must be [rows, tokens, ...]");
}

// Sequence-parallel (Shard(1)), feature-sharded (Shard(2)) and replicated DTensors of rows 2..3:
// each rank's piece is its part of the one-device mask, and replicated pieces agree.
TEST(Dropout, DTensorPiecesAreTheirPartOfTheMask) {
  const at::Tensor want = whole_batch_mask().narrow(0, 2, 2);
  run(2, [&](const comm::ProcessGroup& g) {
    const DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    for (const Placement& placement : {Shard(1), Shard(2), Replicate()}) {
      const at::Tensor x = distribute_tensor(at::ones({2, 8, 6}), mesh, {placement});
      const at::Tensor y = dropped(x, at_step(5, 2));
      ASSERT_TRUE(is_dtensor(y));
      check_close(DTensor(y).full_tensor(), want, "pieces of " + to_string(Placements{placement}), true);
      if (placement.is_replicate())
        check_close(DTensor(y).to_local(), want, "rank " + std::to_string(g.rank()) + "'s replica", true);
    }
  });
}

// A checkpointed region's recomputation runs in backward, where a pipeline has moved on to another
// micro-batch: it replays the first pass's coordinates, so gradients are those without checkpointing.
TEST(Dropout, RecomputationReplaysTheFirstPassesCoordinates) {
  const auto gradient = [](bool checkpointed) {
    auto dropout = std::make_shared<nn::Dropout>(kP);
    dropout->seed(11);
    if (checkpointed) checkpoint(*dropout);
    const at::Tensor x = at::randn({2, 8, 6}, at::TensorOptions().dtype(at::kDouble)).requires_grad_(true);
    const at::Tensor w = at::randn({2, 8, 6}, at::kDouble);
    at::Tensor loss;
    {
      const nn::TokenCoordinatesScope scope(at_step(5));
      const nn::MicroBatchRows rows(2);
      loss = ((*dropout)(x * 1.0) * w).sum();
    }
    const nn::TokenCoordinatesScope later(at_step(5));
    const nn::MicroBatchRows other_rows(0);
    loss.backward();
    return x.grad();
  };
  at::manual_seed(3);
  const at::Tensor plain = gradient(false);
  at::manual_seed(3);
  check_close(gradient(true), plain, "input gradient with a recomputed dropout", true);
  EXPECT_TRUE((plain == 0.0).any().item<bool>()) << "the mask dropped something";
}

// Attention dropout draws by the heads' place among the model's: given the model's 8 query heads,
// a dropping forward that receives 4 with no set_heads (a tensor-parallel plan that forgot it) is
// an error; with set_heads, or with all 8, it draws.
TEST(Dropout, AttentionHeadsOfATensorParallelRankMustBePlaced) {
  nn::CoreAttention core(/*causal=*/true, /*scale=*/0.0, /*dropout=*/0.1, /*heads=*/8);
  core.train();
  const auto attend = [&](int64_t heads) {
    const at::Tensor x = at::randn({1, heads, 4, 8});
    return core.call({x, x, x});
  };
  EXPECT_EQ(attend(8).sizes(), (std::vector<int64_t>{1, 8, 4, 8}));
  expect_error([&] { attend(4); }, "4 of the model's 8 query heads reach this rank, but no plan said which");
  core.eval();
  attend(4);  // nothing drawn: nothing to place
  core.train();
  core.set_heads(4, 8);
  EXPECT_EQ(attend(4).sizes(), (std::vector<int64_t>{1, 4, 4, 8}));
}

}  // namespace
}  // namespace hp::test
