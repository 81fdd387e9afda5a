// redistribute_local moves exactly the right values: every (src, dst) pair among
// {S(0), S(1), R, P(sum)} on 1-D meshes of 1..4 ranks and on a (2, 2) mesh, with an uneven
// 7x5 tensor, compared bitwise with the piece cut from the global tensor. Values are small
// integers in fp32, so sums are exact in any order.
#include <torch/csrc/autograd/autograd.h>

#include <hp/comm/comm_debug_mode.h>
#include <hp/core/error.h>
#include <hp/dtensor/dtensor.h>
#include <hp/dtensor/redistribute.h>

#include "test_util.h"

namespace hp::test {
namespace {

const std::vector<int64_t> kShape = {7, 5};

at::Tensor integers(int seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(-100, 100, kShape, gen, at::TensorOptions().dtype(at::kFloat));
}

at::Tensor piece_of(const at::Tensor& global, const DTensorSpec& spec, const std::vector<int64_t>& coordinate) {
  auto [shape, offset] = spec.local_shape_and_offset(coordinate);
  at::Tensor piece = global;
  for (size_t d = 0; d < shape.size(); ++d) piece = piece.narrow(d, offset[d], shape[d]);
  return piece.contiguous();
}

// This rank's local value of `global` under `spec`; along a Partial(sum) mesh dim the value is
// split as (v - (n-1) m) on coordinate 0 and m elsewhere, which sums back to v exactly.
at::Tensor local_input(const at::Tensor& global, const at::Tensor& noise, const DTensorSpec& spec,
                       const std::vector<int64_t>& coordinate) {
  at::Tensor v = piece_of(global, spec, coordinate);
  const at::Tensor m = piece_of(noise, spec, coordinate);
  for (int64_t i = 0; i < spec.mesh().ndim(); ++i)
    if (spec.placements()[i].is_partial()) v = coordinate[i] == 0 ? v - (spec.mesh().size(i) - 1) * m : m.clone();
  return v;
}

// Checks one redistribute: result's Partial mesh dims summed must equal the piece of `global`.
void check_pair(const DeviceMesh& mesh, const Placements& src, const Placements& dst) {
  const at::Tensor global = integers(1), noise = integers(2);
  const DTensorSpec src_spec(mesh, src, kShape), dst_spec(mesh, dst, kShape);
  const auto coordinate = *mesh.get_coordinate();
  const at::Tensor input = local_input(global, noise, src_spec, coordinate);
  const at::Tensor input_copy = input.clone();
  at::Tensor result = redistribute_local(input, src_spec, dst);
  check_close(input, input_copy, "redistribute left its input unchanged", /*bitwise=*/true);
  for (int64_t i = 0; i < mesh.ndim(); ++i)
    if (dst[i].is_partial()) result = mesh.get_group(i).all_reduce(result.clone());
  check_close(result, piece_of(global, dst_spec, coordinate),
              "redistribute " + to_string(src) + " -> " + to_string(dst) + " on " + mesh.str(), /*bitwise=*/true);
}

const Placements kChoices = {Shard(0), Shard(1), Replicate(), Partial()};

class Redistribute1D : public ::testing::TestWithParam<int> {};

// Every pair on a 1-D mesh, including pieces of size 0 (5 columns over 4 ranks: 2, 2, 1, 0).
TEST_P(Redistribute1D, EveryPairMovesExactValues) {
  run(GetParam(), [](const comm::ProcessGroup& world) {
    DeviceMesh mesh = init_device_mesh(world, "cpu", {world.size()}, {"x"});
    for (const Placement& src : kChoices)
      for (const Placement& dst : kChoices) check_pair(mesh, {src}, {dst});
  });
}

INSTANTIATE_TEST_SUITE_P(MeshSizes, Redistribute1D, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "ranks" + std::to_string(info.param); });

// Every pair of 2-D placement lists on a (2, 2) mesh: 16 x 16 redistributions, nested shards included.
TEST(Redistribute2D, EveryPairMovesExactValues) {
  run(4, [](const comm::ProcessGroup& world) {
    DeviceMesh mesh = init_device_mesh(world, "cpu", {2, 2}, {"dp", "tp"});
    for (const Placement& a : kChoices)
      for (const Placement& b : kChoices)
        for (const Placement& c : kChoices)
          for (const Placement& d : kChoices) check_pair(mesh, {a, b}, {c, d});
  });
}

// A local tensor that does not match its spec is refused with both shapes in the message.
TEST(Redistribute, RejectsALocalTensorOfTheWrongShape) {
  run(2, [](const comm::ProcessGroup& world) {
    DeviceMesh mesh = init_device_mesh(world, "cpu", {2}, {"x"});
    try {
      redistribute_local(at::zeros({7, 5}), DTensorSpec(mesh, {Shard(0)}, kShape), {Replicate()});
    } catch (const Error& e) {
      if (std::string(e.what()).find("has shape [7, 5] but") == std::string::npos) throw;
      return;
    }
    throw std::runtime_error("a full-size local tensor was accepted as a S(0) piece");
  });
}

}  // namespace
}  // namespace hp::test

namespace hp::test {
namespace {

// DTensor::redistribute is differentiable for every pair: the input's gradient is the output's
// gradient moved back (Partial inputs get it Replicate), checked as full tensors on 1-D meshes of
// 1..4 ranks and on (2, 2).
TEST(Redistribute, BackwardOfEveryPair) {
  for (int world : {1, 2, 3, 4}) {
    run(world, [world](const comm::ProcessGroup& g) {
      std::vector<DeviceMesh> meshes = {init_device_mesh(g, "cpu", {world}, {"x"})};
      if (world == 4) meshes.push_back(init_device_mesh(g, "cpu", {2, 2}, {"a", "b"}));
      const at::Tensor full = integers(3), w = integers(4);
      for (const DeviceMesh& mesh : meshes) {
        std::vector<Placements> layouts;
        for (const Placement& p : kChoices) {
          if (mesh.ndim() == 1)
            layouts.push_back({p});
          else
            for (const Placement& q : kChoices) layouts.push_back({p, q});
        }
        for (const Placements& src : layouts) {
          for (const Placements& dst : layouts) {
            const DTensorSpec spec(mesh, src, kShape);
            DTensor x =
                DTensor::from_local(local_input(full, integers(5), spec, *mesh.get_coordinate()), mesh, src, kShape);
            x.requires_grad_(true);
            at::Tensor y = x.redistribute(mesh, dst).full_tensor();
            check_close(y, full, "value " + to_string(src) + " -> " + to_string(dst), true);
            (y * w).sum().backward();
            check_close(DTensor(x.grad()).full_tensor(), w, "grad " + to_string(src) + " -> " + to_string(dst), true);
          }
        }
      }
    });
  }
}

// A wire format carries redistribute's reductions, in forward and in the backward: Partial -> R on
// bf16 gives every rank's piece rounded to bf16 and added in fp32 (exact for two ranks), and the
// gradient of a redistribution that moves nothing forward (R -> R) arrives Partial and is reduced in
// its backward on the wire (with the native format that backward reduces the exact sum). Long
// tensors travel in their own dtype.
TEST(Redistribute, ReductionsOnAWireForwardAndBackward) {
  run(2, [](const comm::ProcessGroup& g) {
    const DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    const auto rounded = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kFloat); };
    const at::Tensor mine = rank_data(g.rank(), {6, 5}, at::kFloat),
                     theirs = rank_data(1 - g.rank(), {6, 5}, at::kFloat);
    comm::CommDebugMode comm;
    const DTensor partial = DTensor::from_local(mine, mesh, {Partial()});
    const at::Tensor sum = partial.redistribute(mesh, {Replicate()}, comm::WireFormat::kBf16).to_local();
    EXPECT_TRUE(at::equal(sum, rounded(mine) + rounded(theirs)));
    EXPECT_FALSE(at::equal(sum, mine + theirs)) << "nothing was rounded: the test would not see a native reduction";
    EXPECT_EQ(comm.on_wire("all_reduce"), 1);

    for (comm::WireFormat wire : {comm::WireFormat::kNative, comm::WireFormat::kBf16}) {
      DTensor x = distribute_tensor(at::zeros({6, 5}), mesh, {Replicate()});
      x.requires_grad_(true);
      const DTensor y = x.redistribute(mesh, {Replicate()}, wire);
      const DTensor grad = DTensor::from_local(mine, mesh, {Partial()});
      const int64_t before = comm.on_wire("all_reduce");
      torch::autograd::backward({y}, {grad});
      const at::Tensor got = DTensor(x.grad()).to_local();
      if (wire == comm::WireFormat::kNative) {
        EXPECT_TRUE(at::equal(got, mine + theirs));
      } else {
        EXPECT_TRUE(at::equal(got, rounded(mine) + rounded(theirs)));
        EXPECT_EQ(comm.on_wire("all_reduce"), before + 1);
      }
    }
    const DTensor counts = DTensor::from_local(at::full({3}, g.rank() + 1, at::kLong), mesh, {Partial()});
    EXPECT_EQ(counts.redistribute(mesh, {Replicate()}, comm::WireFormat::kFp8E4M3).to_local().sum().item<int64_t>(), 9);
    EXPECT_EQ(comm.on_wire("all_reduce"), 2);
  });
}
}  // namespace
}  // namespace hp::test
