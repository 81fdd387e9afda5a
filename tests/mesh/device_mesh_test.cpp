// DeviceMesh follows PyTorch's semantics for coordinates, slicing and flattening, creates one
// group per distinct rank set, and rejects bad meshes with clear messages.
#include <hp/core/error.h>
#include <hp/mesh/device_mesh.h>

#include "test_util.h"

namespace hp::test {
namespace {

using comm::ProcessGroup;

std::vector<int> ints(std::initializer_list<int> v) { return v; }

void expect_eq(const std::vector<int>& got, const std::vector<int>& want, const std::string& what) {
  if (got != want) {
    std::ostringstream msg;
    msg << what << ": got [";
    for (int r : got) msg << r << " ";
    msg << "]";
    throw std::runtime_error(msg.str());
  }
}

template <typename T>
void expect_value(const T& got, const T& want, const std::string& what) {
  if (!(got == want)) throw std::runtime_error(what + ": unexpected value");
}

// World 8, shape (2, 4) named (dp, tp): coordinates, sub-meshes and working per-dim groups.
TEST(DeviceMesh, World8Shape2x4) {
  run(8, [](const ProcessGroup& world) {
    DeviceMesh mesh = init_device_mesh(world, "cpu", {2, 4}, {"dp", "tp"});
    const int r = world.rank();
    expect_value(*mesh.get_coordinate(), std::vector<int64_t>{r / 4, r % 4}, "coordinate");
    expect_value(mesh.get_local_rank("tp"), int64_t{r % 4}, "local rank tp");
    expect_value(mesh.size("dp"), int64_t{2}, "size dp");
    if (r == 5) {
      expect_eq(mesh["tp"].ranks(), ints({4, 5, 6, 7}), "rank 5 tp");
      expect_eq(mesh["dp"].ranks(), ints({1, 5}), "rank 5 dp");
      expect_value(*mesh.get_coordinate(), std::vector<int64_t>{1, 1}, "rank 5 coordinate");
    }
    // The groups really are those rank sets: a sum of world ranks over each.
    const at::Tensor tp_sum = mesh.get_group("tp").all_reduce(at::full({1}, r, at::kLong));
    expect_value(tp_sum.item<int64_t>(), int64_t{(r / 4) * 16 + 6}, "sum over tp group");
    const at::Tensor dp_sum = mesh.get_group("dp").all_reduce(at::full({1}, r, at::kLong));
    expect_value(dp_sum.item<int64_t>(), int64_t{2 * (r % 4) + 4}, "sum over dp group");
    expect_eq(mesh.get_group("dp").ranks(), mesh["dp"].ranks(), "dp group ranks");
  });
}

// World 8, shape (2, 2, 2) named (dp, cp, tp): 2-D slices, flatten, and the flattened name.
TEST(DeviceMesh, World8Shape2x2x2SliceAndFlatten) {
  run(8, [](const ProcessGroup& world) {
    DeviceMesh mesh = init_device_mesh(world, "cpu", {2, 2, 2}, {"dp", "cp", "tp"});
    const int r = world.rank();
    DeviceMesh dp_cp = mesh[{"dp", "cp"}];
    expect_value(dp_cp.shape(), std::vector<int64_t>{2, 2}, "dp_cp shape");
    if (r == 0) expect_eq(dp_cp.ranks(), ints({0, 2, 4, 6}), "rank 0 dp,cp");
    if (r == 3) expect_eq(dp_cp.ranks(), ints({1, 3, 5, 7}), "rank 3 dp,cp");
    DeviceMesh flat = dp_cp.flatten();
    expect_value(flat.dim_names(), std::vector<std::string>{"dp_cp"}, "default flattened name");
    expect_eq(flat.ranks(), dp_cp.ranks(), "flattened ranks");
    expect_value(flat.get_local_rank(0), int64_t{r / 2}, "flattened local rank");
    const int64_t sum = flat.get_group(0).all_reduce(at::full({1}, r, at::kLong)).item<int64_t>();
    expect_value(sum, int64_t{(r % 2 == 0) ? 12 : 16}, "sum over dp_cp");
    // The root now knows "dp_cp", alone and beside original dims (its dims merged, row-major, its
    // group the flattening's), but not beside a dim it merges.
    expect_eq(mesh["dp_cp"].ranks(), flat.ranks(), "root[dp_cp]");
    const DeviceMesh dp_cp_tp = mesh[{"dp_cp", "tp"}];
    expect_value(dp_cp_tp.shape(), std::vector<int64_t>{4, 2}, "(dp_cp, tp) shape");
    expect_value(dp_cp_tp.dim_names(), std::vector<std::string>{"dp_cp", "tp"}, "(dp_cp, tp) names");
    expect_eq(dp_cp_tp.ranks(), ints({0, 1, 2, 3, 4, 5, 6, 7}), "(dp_cp, tp) ranks");
    expect_value(dp_cp_tp.get_local_rank("dp_cp"), int64_t{r / 2}, "local rank on the merged dim");
    expect_value(dp_cp_tp.get_local_rank("tp"), int64_t{r % 2}, "local rank on tp");
    expect_value(&dp_cp_tp.get_group("dp_cp").impl(), &flat.get_group(0).impl(), "the flattening's group");
    expect_value(&dp_cp_tp.get_group("tp").impl(), &mesh.get_group("tp").impl(), "tp's group");
    const DeviceMesh dp_tp_flat = mesh[{"dp", "tp"}].flatten("dp_tp");
    expect_eq(mesh[{"dp_tp"}].ranks(), dp_tp_flat.ranks(), "root[dp_tp]");
    expect_error([&] { mesh[{"dp", "dp_cp"}]; }, "mesh dim named twice in [dp, dp_cp] (standing for (dp, dp, cp))");
    expect_error([&] { mesh[{"dp_tp", "cp"}]; }, "got [dp_tp, cp] (standing for (dp, tp, cp))");
    expect_error([&] { mesh[{"tp", "dp"}]; }, "in mesh order");
    expect_error([&] { mesh["tp"].flatten("dp"); }, "the name 'dp' is already a mesh dim of (dp, cp, tp)");
    // Non-adjacent dims flatten too.
    expect_eq(dp_tp_flat.ranks(), r % 4 < 2 ? ints({0, 1, 4, 5}) : ints({2, 3, 6, 7}), "dp_tp");
  });
}

// A flattening of a flattening beside another dim: on (a, b, c, d) = (2, 2, 1, 2), (b, c) flattened
// as "bc", then (a, bc) as "a_bc"; mesh[{"a_bc", "d"}] stands for (a, b, c, d), with a_bc merged.
TEST(DeviceMesh, NestedFlatteningsSliceBesideOtherDims) {
  run(8, [](const ProcessGroup& world) {
    const int r = world.rank();
    DeviceMesh mesh = init_device_mesh(world, "cpu", {2, 2, 1, 2}, {"a", "b", "c", "d"});
    mesh[{"b", "c"}].flatten("bc");
    const DeviceMesh a_bc = mesh[{"a", "bc"}].flatten("a_bc");  // a flattening of (a, bc)
    expect_eq(a_bc.ranks(), r % 2 == 0 ? ints({0, 2, 4, 6}) : ints({1, 3, 5, 7}), "a_bc ranks");
    const DeviceMesh sliced = mesh[{"a_bc", "d"}];
    expect_value(sliced.shape(), std::vector<int64_t>{4, 2}, "(a_bc, d) shape");
    expect_eq(sliced.ranks(), ints({0, 1, 2, 3, 4, 5, 6, 7}), "(a_bc, d) ranks");
    expect_value(sliced.get_local_rank("a_bc"), int64_t{r / 2}, "local rank on a_bc");
    expect_value(&sliced.get_group("a_bc").impl(), &a_bc.get_group(0).impl(), "a_bc's group");
    expect_value(&sliced.get_group("d").impl(), &mesh.get_group("d").impl(), "d's group");
  });
}

// One group per distinct rank set: sub-meshes, repeated meshes and flattenings reuse it.
TEST(DeviceMesh, GroupsAreCreatedOncePerRankSet) {
  run(4, [](const ProcessGroup& world) {
    DeviceMesh a = init_device_mesh(world, "cpu", {2, 2}, {"dp", "tp"});
    DeviceMesh b = init_device_mesh(world, "cpu", {2, 2}, {"x", "y"});
    expect_value(&a.get_group("tp").impl(), &a["tp"].get_group(0).impl(), "sub-mesh reuses the group");
    expect_value(&a.get_group("tp").impl(), &b.get_group("y").impl(), "second mesh reuses the group");
    expect_value(&a.flatten().get_group(0).impl(), &world.impl(), "flattening everything is the world group");
    DeviceMesh line = init_device_mesh(world, "cpu", {4}, {"dp"});
    expect_value(&line.get_group(0).impl(), &world.impl(), "a 1-D mesh over the world is the world group");
    expect_value(a == b, false, "different names, different meshes");
    expect_value(a == init_device_mesh(world, "cpu", {2, 2}, {"dp", "tp"}), true, "same mesh compares equal");
    expect_value(std::hash<DeviceMesh>()(a),
                 std::hash<DeviceMesh>()(init_device_mesh(world, "cpu", {2, 2}, {"dp", "tp"})),
                 "equal meshes hash equally");
  });
}

// Explicit rank layouts, and processes outside the mesh.
TEST(DeviceMesh, ExplicitRanksAndNonMembers) {
  run(4, [](const ProcessGroup& world) {
    const int r = world.rank();
    DeviceMesh mesh(world, "cpu", at::tensor({0, 2, 1, 3}, at::kLong).view({2, 2}), {"a", "b"});
    expect_eq(mesh["b"].ranks(), r % 2 == 0 ? ints({0, 2}) : ints({1, 3}), "explicit layout dim b");
    DeviceMesh half(world, "cpu", std::vector<int64_t>{2}, std::vector<int>{0, 1}, {"pair"});
    if (r >= 2) {
      expect_value(half.get_coordinate().has_value(), false, "non-member has no coordinate");
      expect_error([&] { half.get_group("pair"); },
                   "world rank " + std::to_string(r) + " is not in DeviceMesh(cpu, (pair=2)");
    } else {
      expect_value(half.get_group("pair").all_reduce(at::ones({1})).item<float>(), 2.0f, "pair sum");
    }
  });
}

// Bad meshes are hp::Errors whose message names the problem.
TEST(DeviceMesh, ClearErrors) {
  run(4, [](const ProcessGroup& world) {
    expect_error(
        [&] {
          init_device_mesh(world, "cpu", {2, 3}, {"dp", "tp"});
        },
        "mesh shape (2, 3) has 6 ranks but the world group has 4");
    expect_error([&] { init_device_mesh(world, "cpu", {2, 2}, {"dp", "dp"}); }, "dim names must be unique");
    expect_error([&] { init_device_mesh(world, "cpu", {2, 2}, {"dp"}); }, "1 dim names (dp) for a 2-D mesh");
    expect_error([&] { init_device_mesh(world, "tpu", {4}); }, "device type 'tpu'");
    DeviceMesh mesh = init_device_mesh(world, "cpu", {2, 2}, {"dp", "tp"});
    expect_error([&] { mesh["pp"]; }, "no mesh dim named 'pp'; this mesh has (dp, tp)");
    expect_error([&] { mesh.get_group(2); }, "mesh dim 2 is out of range");
    expect_error(
        [&] {
          DeviceMesh(world, "cpu", std::vector<int64_t>{2}, std::vector<int>{0, 7});
        },
        "rank 7 is not in the world (ranks 0..3)");
    expect_error(
        [&] {
          DeviceMesh(world, "cpu", std::vector<int64_t>{2}, std::vector<int>{1, 1});
        },
        "rank 1 appears twice");
    expect_error(
        [&] {
          DeviceMesh(world, "cpu", std::vector<int64_t>{3}, std::vector<int>{0, 1});
        },
        "shape (3) holds 3 ranks but 2 ranks were given");
  });
}

}  // namespace
}  // namespace hp::test
