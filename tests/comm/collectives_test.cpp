// Every collective against the value computed locally from all ranks' inputs, for world sizes
// 1-4 and fp32 / bf16 / int64, blocking and async, even and uneven splits.
#include <hp/comm/process_group.h>
#include <hp/comm/tree_reduce.h>
#include <hp/core/chunking.h>

#include "test_util.h"

namespace hp::test {
namespace {

using comm::ProcessGroup;
using comm::ReduceOp;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kLong};

at::Tensor stack_all(int world, std::vector<int64_t> shape, at::ScalarType dtype, int salt = 0) {
  std::vector<at::Tensor> all;
  for (int r = 0; r < world; ++r) all.push_back(rank_data(r, shape, dtype, salt));
  return at::stack(all);
}

// Calls the blocking and the async form; both must give `want`.
template <typename Blocking, typename Async>
void check_both(const std::string& what, const at::Tensor& want, Blocking blocking, Async async) {
  check_close(blocking(), want, what + " (blocking)");
  check_close(async().wait(), want, what + " (async)");
}

class Collectives : public ::testing::TestWithParam<int> {};

// all_reduce of sum/avg/max/min equals the reduction of every rank's input.
TEST_P(Collectives, AllReduceEqualsLocalReduction) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    for (at::ScalarType dtype : kDtypes) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
        if (op == ReduceOp::kAvg && dtype == at::kLong) continue;  // refused, see ErrorsTest
        const at::Tensor want = comm::tree_reduce(stack_all(world, {5, 3}, dtype), op);
        const std::string what = "all_reduce " + comm::to_string(op) + " " + dtype_name(dtype);
        check_both(
            what, want,
            [&] {
              return g.all_reduce(rank_data(g.rank(), {5, 3}, dtype), {op});
            },
            [&] {
              return g.all_reduce_async(rank_data(g.rank(), {5, 3}, dtype), {op});
            });
      }
      // A non-contiguous tensor is reduced in place too.
      at::Tensor t = rank_data(g.rank(), {3, 4}, dtype).t();
      g.all_reduce(t);
      check_close(t, stack_all(world, {3, 4}, dtype).sum(0).to(dtype).t(), "all_reduce of a transposed view");
    }
  });
}

// all_gather concatenates every rank's input along dim, with equal or unequal sizes per rank.
TEST_P(Collectives, AllGatherEvenAndUneven) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    for (at::ScalarType dtype : kDtypes) {
      for (int64_t dim : {0, 1, -1}) {
        std::vector<at::Tensor> pieces;
        for (int r = 0; r < world; ++r) pieces.push_back(rank_data(r, {2, 3}, dtype));
        check_both(
            "all_gather even dim " + std::to_string(dim) + " " + dtype_name(dtype), at::cat(pieces, dim),
            [&] { return g.all_gather(pieces[g.rank()], {dim}); },
            [&] { return g.all_gather_async(pieces[g.rank()], {dim}); });
      }
      // Uneven, including a rank with nothing: rank r has (2r+1) % 3 rows -> 1, 0, 2, 1.
      for (int64_t dim : {0, 1}) {
        std::vector<int64_t> sizes;
        std::vector<at::Tensor> pieces;
        for (int r = 0; r < world; ++r) {
          sizes.push_back((2 * r + 1) % 3);
          std::vector<int64_t> shape{4, 4};
          shape[dim] = sizes.back();
          pieces.push_back(rank_data(r, shape, dtype));
        }
        check_both(
            "all_gather uneven dim " + std::to_string(dim) + " " + dtype_name(dtype), at::cat(pieces, dim),
            [&] {
              return g.all_gather(pieces[g.rank()], {dim, sizes});
            },
            [&] {
              return g.all_gather_async(pieces[g.rank()], {dim, sizes});
            });
        at::Tensor out = at::full_like(at::cat(pieces, dim), 7);
        check_close(g.all_gather_into_tensor(out, pieces[g.rank()], {dim, sizes}), at::cat(pieces, dim),
                    "all_gather_into_tensor uneven dim " + std::to_string(dim));
        check_close(out, at::cat(pieces, dim), "all_gather_into_tensor wrote its output");
      }
      // Even dim-0 gather into a contiguous output receives in place and returns that output.
      std::vector<at::Tensor> rows;
      for (int r = 0; r < world; ++r) rows.push_back(rank_data(r, {3, 2}, dtype, 5));
      at::Tensor out = at::empty({3 * world, 2}, at::TensorOptions().dtype(dtype));
      at::Tensor got = g.all_gather_into_tensor_async(out, rows[g.rank()]).wait();
      check_close(out, at::cat(rows), "all_gather_into_tensor even " + dtype_name(dtype));
      if (!got.is_same(out)) throw std::runtime_error("all_gather_into_tensor did not return its output");
    }
  });
}

// reduce_scatter gives rank r piece r of the reduction: torch.chunk pieces or explicit sizes.
TEST_P(Collectives, ReduceScatterEvenAndUneven) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    for (at::ScalarType dtype : kDtypes) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        if (op == ReduceOp::kAvg && dtype == at::kLong) continue;
        for (int64_t dim : {0, 1}) {
          // 5 along `dim` never splits evenly over 2-4 ranks: torch.chunk pieces, some empty.
          std::vector<int64_t> shape{3, 3};
          shape[dim] = 5;
          const at::Tensor total = comm::tree_reduce(stack_all(world, shape, dtype), op);
          const auto sizes = chunk_sizes(5, world);
          const at::Tensor want = total.narrow(dim, chunk_offset(5, world, g.rank()), sizes[g.rank()]);
          const at::Tensor input = rank_data(g.rank(), shape, dtype);
          const std::string what =
              "reduce_scatter " + comm::to_string(op) + " dim " + std::to_string(dim) + " " + dtype_name(dtype);
          check_both(
              what, want,
              [&] {
                return g.reduce_scatter(input, {op, dim});
              },
              [&] {
                return g.reduce_scatter_async(input, {op, dim});
              });
          at::Tensor out = at::full_like(want, 3);
          check_both(
              what + " into tensor", want,
              [&] {
                return g.reduce_scatter_tensor(out, input, {op, dim});
              },
              [&] {
                return g.reduce_scatter_tensor_async(out, input, {op, dim});
              });
          check_close(out, want, what + " wrote its output");
        }
      }
      // Explicit sizes: rank r keeps r+1 rows.
      std::vector<int64_t> sizes;
      int64_t rows = 0, offset = 0;
      for (int r = 0; r < world; ++r) {
        sizes.push_back(r + 1);
        if (r < g.rank()) offset += r + 1;
        rows += r + 1;
      }
      const at::Tensor total = comm::tree_reduce(stack_all(world, {rows, 2}, dtype), ReduceOp::kSum);
      check_close(g.reduce_scatter(rank_data(g.rank(), {rows, 2}, dtype), {ReduceOp::kSum, 0, sizes}),
                  total.narrow(0, offset, g.rank() + 1), "reduce_scatter explicit sizes " + dtype_name(dtype));
    }
  });
}

// all_to_all sends piece p of every rank to rank p, with even and uneven split sizes.
TEST_P(Collectives, AllToAllEvenAndUneven) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    const int me = g.rank();
    for (at::ScalarType dtype : kDtypes) {
      // Even: 2 rows per destination.
      std::vector<at::Tensor> expected;
      for (int r = 0; r < world; ++r) expected.push_back(rank_data(r, {2 * world, 3}, dtype).narrow(0, 2 * me, 2));
      check_both(
          "all_to_all even " + dtype_name(dtype), at::cat(expected),
          [&] {
            return g.all_to_all(rank_data(me, {2 * world, 3}, dtype));
          },
          [&] {
            return g.all_to_all_async(rank_data(me, {2 * world, 3}, dtype));
          });

      // Uneven: rank r sends (r + p) % 3 rows to rank p (some zero).
      auto rows = [](int from, int to) { return static_cast<int64_t>((from + to) % 3); };
      auto input_of = [&](int r) {
        int64_t total = 0;
        for (int p = 0; p < world; ++p) total += rows(r, p);
        return rank_data(r, {total, 2}, dtype, 7);
      };
      comm::AllToAllOptions opts;
      expected.clear();
      for (int p = 0; p < world; ++p) {
        opts.input_split_sizes.push_back(rows(me, p));
        opts.output_split_sizes.push_back(rows(p, me));
        int64_t offset = 0;
        for (int q = 0; q < me; ++q) offset += rows(p, q);
        expected.push_back(input_of(p).narrow(0, offset, rows(p, me)));
      }
      check_both(
          "all_to_all uneven " + dtype_name(dtype), at::cat(expected), [&] { return g.all_to_all(input_of(me), opts); },
          [&] { return g.all_to_all_async(input_of(me), opts); });
    }
  });
}

// broadcast copies the root's tensor everywhere; send/recv move a tensor between two ranks.
TEST_P(Collectives, BroadcastSendRecvBarrier) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    const int me = g.rank();
    for (at::ScalarType dtype : kDtypes) {
      const int root = world - 1;
      check_both(
          "broadcast " + dtype_name(dtype), rank_data(root, {4, 2}, dtype),
          [&] {
            return g.broadcast(rank_data(me, {4, 2}, dtype), root);
          },
          [&] {
            return g.broadcast_async(rank_data(me, {4, 2}, dtype), root);
          });
      if (world == 1) continue;
      // A ring: every rank sends to the next and receives from the previous, tag per dtype.
      const int next = (me + 1) % world, prev = (me + world - 1) % world;
      const int tag = static_cast<int>(dtype);
      comm::Work sent = g.send_async(rank_data(me, {3}, dtype, 3), next, tag);
      check_close(g.recv(at::empty({3}, at::TensorOptions().dtype(dtype)), prev, tag), rank_data(prev, {3}, dtype, 3),
                  "recv " + dtype_name(dtype));
      sent.wait();
    }
    g.barrier();
    g.barrier_async().wait();
  });
}

// A batch exchanges with both neighbours at once: each rank receives before it sends, which blocking
// calls in that order would deadlock. A bad operation anywhere in a batch posts none of it.
TEST_P(Collectives, BatchIsendIrecv) {
  const int world = GetParam();
  if (world == 1) return;
  run(world, [&](const ProcessGroup& g) {
    const int me = g.rank(), next = (me + 1) % world, prev = (me + world - 1) % world;
    const auto exchange = [&](int salt) {
      const at::Tensor from_prev = at::empty({5}), from_next = at::empty({2, 3});
      std::vector<comm::Work> works =
          g.batch_isend_irecv({comm::P2POp::recv(from_prev, prev, 1), comm::P2POp::recv(from_next, next, 2),
                               comm::P2POp::send(rank_data(me, {5}, at::kFloat, salt), next, 1),
                               comm::P2POp::send(rank_data(me, {2, 3}, at::kFloat, salt), prev, 2)});
      if (works.size() != 4)
        throw std::runtime_error("batch_isend_irecv returned " + std::to_string(works.size()) + " works");
      for (comm::Work& w : works) w.wait();
      check_close(from_prev, rank_data(prev, {5}, at::kFloat, salt), "batch: from the previous rank");
      check_close(from_next, rank_data(next, {2, 3}, at::kFloat, salt), "batch: from the next rank");
    };
    exchange(1);
    test::expect_error(
        [&] {
          g.batch_isend_irecv({comm::P2POp::recv(at::empty({5}), prev, 1), comm::P2POp::send(at::ones({5}), world, 1)});
        },
        {"batch_isend_irecv: operation 1 (send)", "peer " + std::to_string(world)});
    exchange(2);  // a receive posted by the refused batch would have taken this exchange's first message
  });
}

// A batch issued while composed collectives (reduce_scatter: all_to_all then a local tree sum, run
// on the group's queue) are still queued ahead of it: every send and receive of it is still posted
// before any is waited on. Sends come first, so a queue that waited for each would deadlock.
TEST_P(Collectives, BatchIsendIrecvBehindComposedCollectives) {
  const int world = GetParam();
  if (world == 1) return;
  run(world, [&](const ProcessGroup& g) {
    const int me = g.rank(), next = (me + 1) % world, prev = (me + world - 1) % world;
    std::vector<comm::Work> ahead;
    for (int i = 0; i < 4; ++i) ahead.push_back(g.reduce_scatter_async(rank_data(me, {world * 4096}, at::kFloat, i)));
    const at::Tensor from_prev = at::empty({1024});
    std::vector<comm::Work> works = g.batch_isend_irecv(
        {comm::P2POp::send(rank_data(me, {1024}, at::kFloat, 9), next, 3), comm::P2POp::recv(from_prev, prev, 3)});
    for (comm::Work& w : works) w.wait();
    for (comm::Work& w : ahead) w.wait();
    check_close(from_prev, rank_data(prev, {1024}, at::kFloat, 9), "batch behind composed collectives");
  });
}

// Many async collectives in flight at once, mixing native and composed ones, complete in order
// with the right values (issue order is program order on every rank).
TEST_P(Collectives, ManyAsyncInFlight) {
  const int world = GetParam();
  run(world, [&](const ProcessGroup& g) {
    std::vector<comm::Work> works;
    std::vector<at::Tensor> wants;
    for (int i = 0; i < 12; ++i) {
      const at::ScalarType dtype = kDtypes[i % 3];
      if (i % 2 == 0) {
        works.push_back(g.all_reduce_async(rank_data(g.rank(), {64}, dtype, i)));
        wants.push_back(comm::tree_reduce(stack_all(world, {64}, dtype, i), ReduceOp::kSum));
      } else {
        works.push_back(g.reduce_scatter_async(rank_data(g.rank(), {8, 2}, dtype, i)));
        const at::Tensor total = comm::tree_reduce(stack_all(world, {8, 2}, dtype, i), ReduceOp::kSum);
        wants.push_back(total.narrow(0, chunk_offset(8, world, g.rank()), chunk_sizes(8, world)[g.rank()]));
      }
    }
    for (int i = static_cast<int>(works.size()) - 1; i >= 0; --i)  // wait in reverse on purpose
      check_close(works[i].wait(), wants[i], "async collective #" + std::to_string(i));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace hp::test
