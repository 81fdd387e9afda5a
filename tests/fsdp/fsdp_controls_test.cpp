// The FSDPModule controls a recipe or a user calls by hand: unshard/reshard, the reduce op and the
// gradient scaling factor, each against plain FSDP on the same data.
#include <hp/dtensor/dtensor.h>
#include <hp/nn/init.h>
#include <hp/nn/layers.h>
#include <hp/parallel/fsdp.h>

#include <functional>
#include <string>
#include <vector>

#include "test_util.h"

namespace hp::test {
namespace {

// A Linear(8, 6) as one FSDP unit on `world` ranks, drawn from seed 3, its unit handle, and the
// gradients (whole) of sum(w x) for this rank's own x, after `adjust` set the unit's controls.
struct Sharded {
  std::shared_ptr<nn::Linear> linear = std::make_shared<nn::Linear>(8, 6);
  FSDPModule unit;
  explicit Sharded(const comm::ProcessGroup& world)
      : unit(fully_shard(*linear, init_device_mesh(world, "cpu", {world.size()}, {"dp"}))) {
    nn::init_parameters(*linear, 3);
  }
};

std::vector<at::Tensor> gradients(const comm::ProcessGroup& world, const std::function<void(FSDPModule&)>& adjust) {
  Sharded m(world);
  adjust(m.unit);
  (*m.linear)(rank_data(world.rank(), {5, 8}, at::kFloat, 1)).sum().backward();
  std::vector<at::Tensor> out;
  for (const auto& item : m.linear->named_parameters()) out.push_back(whole(item.value().grad()));
  return out;
}

// unshard() puts the whole parameters in place (plain tensors, equal to the gathered shards) and
// reshard() the shards back (DTensors with this rank's original piece, bitwise).
TEST(FsdpControls, UnshardPutsTheWholeParametersInPlaceAndReshardTheShards) {
  run(2, [](const comm::ProcessGroup& world) {
    Sharded m(world);
    const at::Tensor shard = DTensor(m.linear->param("weight")).to_local().clone();
    const at::Tensor full = whole(m.linear->param("weight")).clone();
    m.unit.unshard();
    const at::Tensor gathered = m.linear->param("weight");
    if (is_dtensor(gathered)) throw std::runtime_error("after unshard() the weight is still a DTensor");
    check_close(gathered, full, "unsharded weight", /*bitwise=*/true);
    m.unit.reshard();
    const at::Tensor back = m.linear->param("weight");
    if (!is_dtensor(back)) throw std::runtime_error("after reshard() the weight is not a DTensor");
    check_close(DTensor(back).to_local(), shard, "resharded piece", /*bitwise=*/true);
  });
}

// set_reduce_op(kSum) gives the sum over ranks, twice the default mean (bitwise: a power of two);
// set_gradient_scaling_factor(0.25) a quarter of the mean; a reduce op other than sum or avg is an
// error naming it.
TEST(FsdpControls, ReduceOpAndScalingFactorScaleTheGradients) {
  run(2, [](const comm::ProcessGroup& world) {
    const auto mean = gradients(world, [](FSDPModule&) {});
    const auto sum = gradients(world, [](FSDPModule& unit) { unit.set_reduce_op(comm::ReduceOp::kSum); });
    const auto quarter = gradients(world, [](FSDPModule& unit) { unit.set_gradient_scaling_factor(0.25); });
    for (size_t i = 0; i < mean.size(); ++i) {
      check_close(sum[i], mean[i] * 2, "kSum against the mean, gradient " + std::to_string(i), /*bitwise=*/true);
      check_close(quarter[i], mean[i] * 0.25, "scaled by 0.25, gradient " + std::to_string(i), /*bitwise=*/true);
    }
    Sharded m(world);
    expect_error([&] { m.unit.set_reduce_op(comm::ReduceOp::kMax); }, "gradients reduce by sum or avg");
  });
}

}  // namespace
}  // namespace hp::test
