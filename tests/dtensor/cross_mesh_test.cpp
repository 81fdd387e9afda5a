// Moving a tensor between meshes of different ranks and shapes: every destination piece is exactly
// the matching piece of the global tensor, and back again.
#include <hp/core/error.h>
#include <hp/dtensor/redistribute.h>

#include "test_util.h"

namespace hp::test {
namespace {

at::Tensor piece(const at::Tensor& full, const DTensorSpec& spec) {
  auto [shape, offset] = spec.local_shape_and_offset(*spec.mesh().get_coordinate());
  at::Tensor t = full;
  for (size_t d = 0; d < shape.size(); ++d) t = t.narrow(d, offset[d], shape[d]);
  return t.contiguous();
}

// 4 ranks -> a 2-rank sub-mesh and back, and a (2, 2) mesh -> a 3-rank mesh, for several
// placements, with uneven 7x5 pieces; values bitwise.
TEST(CrossMesh, FourToTwoRanksAndBack) {
  run(4, [](const comm::ProcessGroup& g) {
    const at::Tensor full = at::randn({7, 5}, at::make_generator<at::CPUGeneratorImpl>(9));
    DeviceMesh four = init_device_mesh(g, "cpu", {4}, {"x"});
    DeviceMesh square = init_device_mesh(g, "cpu", {2, 2}, {"a", "b"});
    DeviceMesh two(g, "cpu", std::vector<int64_t>{2}, std::vector<int>{3, 1}, {"y"});  // ranks 3 and 1, in that order
    DeviceMesh three(g, "cpu", std::vector<int64_t>{3}, std::vector<int>{0, 2, 3}, {"z"});
    const std::vector<std::tuple<DeviceMesh, Placements, DeviceMesh, Placements>> moves = {
        {four, {Shard(0)}, two, {Shard(1)}},
        {four, {Replicate()}, two, {Shard(0)}},
        {square, {Shard(0), Shard(1)}, three, {Shard(0)}},
        {square, {Replicate(), Shard(0)}, three, {Replicate()}}};
    for (const auto& [from_mesh, from, to_mesh, to] : moves) {
      const DTensorSpec src(from_mesh, from, {7, 5});
      const at::Tensor mine = src.mesh().get_coordinate() ? piece(full, src) : at::Tensor();
      at::Tensor there = redistribute_across_meshes(mine, src, to_mesh, to);
      const DTensorSpec dst(to_mesh, to, {7, 5});
      const std::string what =
          to_string(from) + " on " + from_mesh.str() + " -> " + to_string(to) + " on " + to_mesh.str();
      if (to_mesh.get_coordinate())
        check_close(there, piece(full, dst), what, /*bitwise=*/true);
      else if (there.defined())
        throw std::runtime_error(what + ": a rank outside the target got a piece");
      // And back to where it came from.
      at::Tensor back = redistribute_across_meshes(there, dst, from_mesh, from);
      check_close(back, mine, "back: " + what, true);
    }
    try {
      redistribute_across_meshes(at::zeros({7, 5}), DTensorSpec(four, {Partial()}, {7, 5}), two, {Replicate()});
      throw std::runtime_error("a Partial source was accepted");
    } catch (const Error& e) {
      if (std::string(e.what()).find("reduce its Partial dims on the source mesh first") == std::string::npos) throw;
    }
  });
}

}  // namespace
}  // namespace hp::test
