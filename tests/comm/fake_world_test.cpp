// A fake world (hp::comm::fake_world) plays one rank of a world of any size in this thread alone:
// groups and meshes are built without peers, collectives return at once with the shapes a real
// world gives, meta tensors stay meta, and tensors with values get a symmetric world's values.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "hp/comm/comm_debug_mode.h"
#include "hp/comm/init.h"
#include "hp/core/memory_tracker.h"
#include "hp/mesh/device_mesh.h"
#include "test_util.h"

namespace hp::test {
namespace {

at::Tensor meta(std::vector<int64_t> shape) { return at::empty(shape, at::TensorOptions().device(at::kMeta)); }

// Every collective of meta tensors returns the shape a real world gives, counted with its bytes.
TEST(FakeWorld, CollectivesOfMetaTensorsHaveTheRealShapes) {
  const comm::ProcessGroup world = comm::fake_world(8, 3);
  EXPECT_EQ(world.rank(), 3);
  EXPECT_EQ(world.size(), 8);
  comm::CommDebugMode comm;
  const at::Tensor gathered = world.all_gather(meta({2, 5}), {1});
  EXPECT_TRUE(gathered.is_meta());
  EXPECT_EQ(gathered.sizes(), at::IntArrayRef({2, 40}));
  comm::AllGatherOptions uneven;
  uneven.sizes = {1, 1, 1, 2, 1, 1, 1, 1};
  EXPECT_EQ(world.all_gather(meta({2, 5}), uneven).sizes(), at::IntArrayRef({9, 5}));
  // torch.chunk pieces of 10 over 8 ranks: 2, 2, 2, 2, 2 and three empty; rank 3 keeps 2 rows.
  EXPECT_EQ(world.reduce_scatter(meta({10, 3})).sizes(), at::IntArrayRef({2, 3}));
  comm::AllToAllOptions splits;
  splits.input_split_sizes = {1, 0, 2, 3, 0, 0, 0, 1};
  splits.output_split_sizes = {4, 4, 0, 3, 1, 1, 1, 1};
  EXPECT_EQ(world.all_to_all(meta({7, 2}), splits).sizes(), at::IntArrayRef({15, 2}));
  const at::Tensor reduced = meta({4});
  EXPECT_TRUE(world.all_reduce(reduced).is_same(reduced));
  const at::Tensor out = meta({8, 2});
  EXPECT_TRUE(world.all_gather_into_tensor(out, meta({1, 2})).is_same(out));
  world.barrier();
  // Counted like real collectives, with the bytes this rank puts in.
  EXPECT_EQ(comm.count("all_gather"), 3);
  EXPECT_EQ(comm.bytes("all_gather"), 2 * 2 * 5 * 4 + 1 * 2 * 4);
  EXPECT_EQ(comm.count("reduce_scatter"), 1);
  EXPECT_EQ(comm.count("all_to_all"), 1);
  EXPECT_EQ(comm.count("all_reduce"), 1);
}

// Tensors with values get what a world of ranks that all hold this rank's values gives.
TEST(FakeWorld, TensorsWithValuesGetWhatASymmetricWorldGives) {
  const comm::ProcessGroup world = comm::fake_world(4, 1);
  const at::Tensor x = at::arange(6, at::kLong).view({3, 2});
  check_close(world.all_reduce(x.clone()), x * 4, "sum");
  check_close(world.all_reduce(x.to(at::kDouble), {comm::ReduceOp::kAvg}), x.to(at::kDouble), "avg");
  check_close(world.all_reduce(x.clone(), {comm::ReduceOp::kMax}), x, "max");
  check_close(world.all_gather(x), at::cat({x, x, x, x}), "all_gather");
  comm::AllGatherOptions uneven;
  uneven.sizes = {3, 3, 1, 3};
  check_close(world.all_gather(x, uneven), at::cat({x, x, at::zeros({1, 2}, at::kLong), x}), "uneven all_gather");
  // torch.chunk of 8 rows over 4 ranks: rank 1 gets rows 2 and 3 of the sum of 4 equal inputs.
  const at::Tensor rows = at::arange(16, at::kLong).view({8, 2});
  check_close(world.reduce_scatter(rows), rows.narrow(0, 2, 2) * 4, "reduce_scatter");
  // Rank 1 sends itself rows [1, 3): every rank sends it those.
  comm::AllToAllOptions splits;
  splits.input_split_sizes = {1, 2, 0, 0};
  splits.output_split_sizes = {2, 2, 1, 2};
  const at::Tensor own = x.narrow(0, 1, 2);
  check_close(world.all_to_all(x, splits), at::cat({own, own, at::zeros({1, 2}, at::kLong), own}), "all_to_all");
  check_close(world.broadcast(x.clone(), 0), x, "broadcast");
}

// Rank 77 of 256 builds a 3-D mesh and its groups alone, with the real coordinates and members.
TEST(FakeWorld, GroupsAndMeshesAreBuiltWithoutPeers) {
  const comm::ProcessGroup world = comm::fake_world(256, 77);
  const DeviceMesh mesh(world, "cpu", at::arange(256, at::kLong).view({4, 8, 8}), {"dp_shard", "tp", "cp"});
  EXPECT_EQ(mesh.get_coordinate(), (std::vector<int64_t>{1, 1, 5}));
  const comm::ProcessGroup& tp = mesh.get_group("tp");
  EXPECT_EQ(tp.size(), 8);
  EXPECT_EQ(tp.ranks(), (std::vector<int>{69, 77, 85, 93, 101, 109, 117, 125}));
  EXPECT_EQ(tp.rank(), 1);
  EXPECT_EQ(tp.all_gather(meta({3})).sizes(), at::IntArrayRef({24}));
  EXPECT_EQ(mesh["dp_shard"].ranks(), (std::vector<int>{13, 77, 141, 205}));
}

// A real group names meta tensors as a fake world's; a rank outside the world is refused.
TEST(FakeWorld, RealGroupsRefuseMetaTensors) {
  run(2, [](const comm::ProcessGroup& world) {
    expect_error([&] { world.all_reduce(meta({2})); }, "meta tensors are accepted only by hp::comm::fake_world groups");
  });
  expect_error([] { comm::fake_world(4, 4); }, "fake_world: rank 4 is not in [0, 4)");
}

// Fake worlds sharing a FakeExchange, on threads: a message with values reaches the matching
// receive of the peer's world (which waits for it); meta tensors move nothing; an abort fails a
// waiting receive; a receive nobody answers fails after the group's timeout.
TEST(FakeWorld, AnExchangeCarriesMessagesWithValuesBetweenWorlds) {
  const auto exchange = std::make_shared<comm::FakeExchange>();
  comm::ProcessGroupOptions options;
  options.timeout = std::chrono::seconds(20);
  // A thread's failure fails the test instead of ending the process.
  const auto on_thread = [](const std::function<void()>& fn) {
    return std::thread([fn] {
      try {
        fn();
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    });
  };
  at::Tensor first = at::zeros({3}, at::kLong), second = at::zeros({2}, at::kLong);
  std::thread receiver = on_thread([&] {
    const comm::ProcessGroup world = comm::fake_world(4, 2, options, exchange);
    const comm::ProcessGroup pair = world.new_group({1, 2});
    pair.recv(first, 0, 7);  // waits for rank 1's send
    pair.recv(second, 0, 6);
    const at::Tensor m = meta({2});
    EXPECT_TRUE(pair.recv(m, 0, 8).is_meta());  // nothing to wait for
  });
  const comm::ProcessGroup world = comm::fake_world(4, 1, options, exchange);
  const comm::ProcessGroup pair = world.new_group({1, 2});
  pair.send(meta({2}), 1, 8);
  pair.send(at::arange(5, 7), 1, 6);  // each tag its own message, in whatever order
  pair.send(at::arange(3), 1, 7);
  receiver.join();
  EXPECT_TRUE(first.equal(at::arange(3)));
  EXPECT_TRUE(second.equal(at::arange(5, 7)));
  pair.send(at::arange(4), 1, 5);
  expect_error(
      [&] {
        comm::fake_world(4, 2, options, exchange).new_group({1, 2}).recv(at::zeros({3}), 0, 5);
      },
      "the peer sent Long [4] into Float [3]");

  std::thread waiting = on_thread([&] {
    const comm::ProcessGroup world = comm::fake_world(4, 2, options, exchange);
    expect_error([&] { world.new_group({1, 2}).recv(at::zeros({1}), 0, 9); }, "the stage before failed");
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  exchange->abort("the stage before failed");
  waiting.join();

  options.timeout = std::chrono::milliseconds(100);
  const auto quiet = std::make_shared<comm::FakeExchange>();
  expect_error([&] { comm::fake_world(2, 0, options, quiet).recv(at::zeros({1}), 1, 0); },
               "no fake world sharing this exchange sent it within 100 ms");
}

// The copy an exchange holds until the peer takes it is the simulation's, not memory a real send
// holds: it is charged to nobody, so a dry run's peak does not depend on when its peer runs (it
// was charged to the sender until the receiving thread freed it).
TEST(FakeWorld, AnExchangesCopyIsChargedToNobody) {
  const auto exchange = std::make_shared<comm::FakeExchange>();
  const comm::ProcessGroup sender = comm::fake_world(2, 0, {}, exchange);
  const MemoryTracker tracker;
  const at::Tensor message = at::arange(9);  // 72 bytes, as a pipeline's shape description
  const int64_t before = tracker.current();
  sender.send(message, 1, 3);
  EXPECT_EQ(tracker.current(), before);
  at::Tensor got = at::zeros({9}, at::kLong);
  comm::fake_world(2, 1, {}, exchange).recv(got, 0, 3);
  EXPECT_TRUE(got.equal(message));
}

}  // namespace
}  // namespace hp::test
