// hp::register_sharding_rule: an op without a rule fails naming it; once a rule is registered in
// C++, the op runs on DTensors and equals the op on the whole tensor.
#include <ATen/ATen.h>
#include <hp/dtensor/dtensor.h>
#include <hp/dtensor/sharding_rule.h>

#include "test_util.h"

namespace hp::test {
namespace {

// cumprod along `dim`: a shard on another dim survives (each row's product is its own); a shard on
// `dim`, or a Partial (a product is not linear), is gathered first. The output keeps the input's
// placements.
OpSharding cumprod_rule(const OpCall& call) {
  const int64_t dim = call.args.at(1).toInt();
  const int64_t rank = static_cast<int64_t>(call.output_shape(0).size());
  Placements placements = call.inputs.at(0).placements();
  for (Placement& p : placements)
    if (p.is_partial() || p.is_shard((dim + rank) % rank)) p = Replicate();
  return {{placements}, {placements}};
}

// aten::cumprod has no built-in rule; registered from C++, it runs on every 1-D placement of a
// [4, 6] tensor, along either dim, and equals cumprod of the whole tensor bitwise.
TEST(RuleRegistration, ARuleRegisteredInCppShardsAnOpThatHadNone) {
  const at::Tensor global = rank_data(0, {4, 6}, at::kFloat, 31) * 0.5 + 1.0;
  run(2, [&](const comm::ProcessGroup& world) {
    const DeviceMesh mesh = init_device_mesh(world, "cpu", {2}, {"x"});
    const DTensor sharded = distribute_tensor(global, mesh, {Shard(0)});
    if (!find_sharding_rule("aten::cumprod"))
      expect_error([&] { at::cumprod(sharded, 1); }, "no sharding rule for aten::cumprod");
  });
  register_sharding_rule("aten::cumprod", cumprod_rule);
  run(2, [&](const comm::ProcessGroup& world) {
    const DeviceMesh mesh = init_device_mesh(world, "cpu", {2}, {"x"});
    for (const Placement& p : {Shard(0), Shard(1), Replicate()})
      for (const int64_t dim : {0, 1, -1}) {
        const at::Tensor got = whole(at::cumprod(distribute_tensor(global, mesh, {p}), dim));
        check_close(got, at::cumprod(global, dim), "cumprod along " + std::to_string(dim) + " of " + p.str(),
                    /*bitwise=*/true);
      }
  });
}

}  // namespace
}  // namespace hp::test
