// hp::AdamW's foreach path equals torch::optim::AdamW bitwise: plain parameters, DTensor
// parameters (each rank updates its shard), weight decay and amsgrad.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/mesh/device_mesh.h"
#include "hp/optim/adamw.h"
#include "test_util.h"

namespace hp {
namespace {

// Runs 3 steps of `make`'s optimizer on copies of `params` with fixed gradients; returns the results.
template <typename Make>
std::vector<at::Tensor> three_steps(const std::vector<at::Tensor>& params, const Make& make) {
  std::vector<at::Tensor> ps;
  for (const auto& p : params) ps.push_back(p.detach().clone().set_requires_grad(true));
  auto optimizer = make(ps);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = (ps[i].detach() * (step + 1.5) - 0.25);
    optimizer->step();
  }
  return ps;
}

void expect_bitwise_equal_to_torch(const std::vector<at::Tensor>& params, const torch::optim::AdamWOptions& options) {
  const auto ours =
      three_steps(params, [&](std::vector<at::Tensor> ps) { return std::make_unique<AdamW>(ps, options); });
  const auto torchs = three_steps(
      params, [&](std::vector<at::Tensor> ps) { return std::make_unique<torch::optim::AdamW>(ps, options); });
  for (size_t i = 0; i < params.size(); ++i)
    test::check_close(test::whole(ours[i].detach()), test::whole(torchs[i].detach()), "parameter " + std::to_string(i),
                      /*bitwise=*/true);
}

TEST(AdamWForeach, PlainParametersMatchTorchBitwise) {
  const std::vector<at::Tensor> params = {test::rank_data(0, {7, 5}, at::kFloat, 1),
                                          test::rank_data(0, {13}, at::kFloat, 2),
                                          test::rank_data(0, {4, 4, 3}, at::kFloat, 3)};
  expect_bitwise_equal_to_torch(params, torch::optim::AdamWOptions(1e-2));
  expect_bitwise_equal_to_torch(params, torch::optim::AdamWOptions(3e-3).weight_decay(0.1).betas({0.8, 0.95}));
  expect_bitwise_equal_to_torch(params, torch::optim::AdamWOptions(1e-2).amsgrad(true).eps(1e-6));
}

TEST(AdamWForeach, ShardedParametersMatchTorchBitwise) {
  test::run(2, [](const comm::ProcessGroup& world) {
    const DeviceMesh mesh = init_device_mesh(world, "cpu", {2});
    const std::vector<at::Tensor> params = {
        distribute_tensor(test::rank_data(0, {7, 5}, at::kFloat, 1), mesh, {Shard(0)}),
        distribute_tensor(test::rank_data(0, {6, 9}, at::kFloat, 2), mesh, {Shard(1)}),
        distribute_tensor(test::rank_data(0, {5}, at::kFloat, 3), mesh, {Replicate()})};
    expect_bitwise_equal_to_torch(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
  });
}

}  // namespace
}  // namespace hp
