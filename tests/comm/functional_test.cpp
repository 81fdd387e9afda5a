// Backward of each differentiable collective equals its transpose, computed by hand from every
// rank's upstream gradient (loss_r = sum(y_r * w_r), so dL/dy_r = w_r).
#include <hp/comm/functional.h>
#include <hp/core/chunking.h>
#include <hp/core/error.h>

#include <numeric>

#include "test_util.h"

namespace hp::test {
namespace {

using comm::ProcessGroup;
using comm::ReduceOp;

// Runs y = collective(x_r) and backward of sum(y * w_r); returns x_r's gradient.
at::Tensor grad_through(const std::function<at::Tensor(const at::Tensor&)>& collective, const at::Tensor& x,
                        const std::function<at::Tensor(const at::Tensor&)>& weight_for_output) {
  at::Tensor leaf = x.clone().requires_grad_(true);
  at::Tensor y = collective(leaf);
  if (!y.requires_grad()) throw std::runtime_error("output of a differentiable collective does not require grad");
  (y * weight_for_output(y)).sum().backward();
  return leaf.grad();
}

class FunctionalBackward : public ::testing::TestWithParam<int> {};

// all_reduce: y = sum_j x_j on every rank, so dL/dx_r = sum_j w_j (avg: divided by n).
TEST_P(FunctionalBackward, AllReduceIsItsOwnTranspose) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      at::Tensor want = at::zeros({4, 3});
      for (int r = 0; r < world; ++r) want += rank_data(r, {4, 3}, at::kFloat, 1);
      if (op == ReduceOp::kAvg) want /= world;
      at::Tensor grad = grad_through([&](const at::Tensor& x) { return comm::functional::all_reduce(x, g, op); },
                                     rank_data(g.rank(), {4, 3}, at::kFloat),
                                     [&](const at::Tensor&) {
                                       return rank_data(g.rank(), {4, 3}, at::kFloat, 1);
                                     });
      check_close(grad, want, "grad of all_reduce " + comm::to_string(op));
    }
  });
}

// all_gather: every rank holds cat_j x_j, so dL/dx_r = sum_j (w_j)[piece r] (a reduce_scatter).
TEST_P(FunctionalBackward, AllGatherTransposeIsReduceScatter) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    std::vector<int64_t> sizes;
    for (int r = 0; r < world; ++r) sizes.push_back(r % 2 + 1);  // uneven: 1, 2, 1, 2
    const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
    int64_t offset = 0;
    for (int r = 0; r < g.rank(); ++r) offset += sizes[r];
    at::Tensor want = at::zeros({3, sizes[g.rank()]});
    for (int r = 0; r < world; ++r) want += rank_data(r, {3, total}, at::kFloat, 1).narrow(1, offset, sizes[g.rank()]);
    at::Tensor grad = grad_through(
        [&](const at::Tensor& x) {
          return comm::functional::all_gather(x, g, {1, sizes});
        },
        rank_data(g.rank(), {3, sizes[g.rank()]}, at::kFloat),
        [&](const at::Tensor&) {
          return rank_data(g.rank(), {3, total}, at::kFloat, 1);
        });
    check_close(grad, want, "grad of all_gather");
  });
}

// reduce_scatter: y_j = sum_i x_i[piece j], so dL/dx_r = cat_j w_j (an all_gather; avg: / n).
TEST_P(FunctionalBackward, ReduceScatterTransposeIsAllGather) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    const auto sizes = chunk_sizes(7, world);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      std::vector<at::Tensor> pieces;
      for (int r = 0; r < world; ++r) pieces.push_back(rank_data(r, {sizes[r], 2}, at::kFloat, 1));
      at::Tensor want = at::cat(pieces);
      if (op == ReduceOp::kAvg) want /= world;
      at::Tensor grad =
          grad_through([&](const at::Tensor& x) { return comm::functional::reduce_scatter(x, g, {op}); },
                       rank_data(g.rank(), {7, 2}, at::kFloat), [&](const at::Tensor&) { return pieces[g.rank()]; });
      check_close(grad, want, "grad of reduce_scatter " + comm::to_string(op));
    }
  });
}

// all_to_all: the gradient of piece p of x_r is the piece of w_p that came from r (inverse a2a).
TEST_P(FunctionalBackward, AllToAllTransposeIsInverseAllToAll) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    const int me = g.rank();
    auto rows = [](int from, int to) { return static_cast<int64_t>((from + 2 * to) % 3 + 1); };
    comm::AllToAllOptions opts;
    std::vector<at::Tensor> want;
    for (int p = 0; p < world; ++p) {
      opts.input_split_sizes.push_back(rows(me, p));
      opts.output_split_sizes.push_back(rows(p, me));
      // w_p is laid out as the pieces p received from ranks 0..n-1; find the one from `me`.
      int64_t received_before = 0, received_total = 0;
      for (int q = 0; q < world; ++q) {
        if (q < me) received_before += rows(q, p);
        received_total += rows(q, p);
      }
      want.push_back(rank_data(p, {received_total, 2}, at::kFloat, 1).narrow(0, received_before, rows(me, p)));
    }
    int64_t sent_total = 0;
    for (int p = 0; p < world; ++p) sent_total += rows(me, p);
    at::Tensor grad = grad_through([&](const at::Tensor& x) { return comm::functional::all_to_all(x, g, opts); },
                                   rank_data(me, {sent_total, 2}, at::kFloat),
                                   [&](const at::Tensor& y) {
                                     return rank_data(me, {y.size(0), 2}, at::kFloat, 1);
                                   });
    check_close(grad, at::cat(want), "grad of all_to_all");
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FunctionalBackward, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// max/min are refused for inputs that need a gradient instead of silently giving a wrong one.
TEST(FunctionalErrors, NonLinearReductionNeedsDetachedInput) {
  run(2, [](const ProcessGroup& g) {
    at::Tensor x = at::ones({2}).requires_grad_(true);
    try {
      comm::functional::all_reduce(x, g, ReduceOp::kMax);
    } catch (const Error& e) {
      if (std::string(e.what()).find("not differentiable") == std::string::npos) throw;
      return;
    }
    throw std::runtime_error("functional all_reduce(max) on a grad-requiring input did not throw");
  });
}

}  // namespace
}  // namespace hp::test
