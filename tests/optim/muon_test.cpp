// Muon on one rank matches a straightforward implementation of the public reference written here;
// distributed Muon (owner-based orthogonalization of sharded matrices) on 4 ranks matches
// single-device Muon within 1e-6.
#include <hp/comm/comm_debug_mode.h>
#include <hp/dtensor/dtensor.h>
#include <hp/optim/muon.h>
#include <torch/types.h>

#include "test_util.h"

namespace hp::test {
namespace {

constexpr int kSteps = 3;
const std::vector<std::vector<int64_t>> kShapes = {{8, 6}, {5, 12}, {7, 7}, {12, 4}};

at::Tensor initial(size_t i) { return at::randn(kShapes[i], at::make_generator<at::CPUGeneratorImpl>(10 + i)); }
at::Tensor gradient(size_t i, int step) {
  return at::randn(kShapes[i], at::make_generator<at::CPUGeneratorImpl>(100 * step + i));
}

// The public reference, transcribed: momentum.lerp_(g, 1 - beta); update = g.lerp(momentum, beta);
// quintic Newton-Schulz on the wide orientation, normalized by the Frobenius norm; scaled by
// sqrt(max(1, rows / cols)); p -= lr * update.
std::vector<at::Tensor> reference(double lr) {
  std::vector<at::Tensor> params, momentum;
  for (size_t i = 0; i < kShapes.size(); ++i) params.push_back(initial(i)), momentum.push_back(at::zeros(kShapes[i]));
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor g = gradient(i, step);
      momentum[i].lerp_(g, 1 - 0.95);
      at::Tensor x = g.lerp(momentum[i], 0.95);
      const bool tall = x.size(0) > x.size(1);
      if (tall) x = x.t();
      x = x / (x.norm() + 1e-7);
      for (int k = 0; k < 5; ++k) {
        const at::Tensor a = x.mm(x.t());
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a.mm(a)).mm(x);
      }
      if (tall) x = x.t();
      params[i] -= lr * x * std::sqrt(std::max(1.0, double(kShapes[i][0]) / double(kShapes[i][1])));
    }
  }
  return params;
}

std::vector<at::Tensor> single_device(double lr) {
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < kShapes.size(); ++i) params.push_back(initial(i).requires_grad_(true));
  Muon muon(params, MuonOptions(lr));
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = gradient(i, step);
    muon.step();
  }
  return params;
}

TEST(Muon, MatchesThePublicReference) {
  const auto want = reference(0.02), got = single_device(0.02);
  for (size_t i = 0; i < want.size(); ++i)
    check_relative(got[i].detach(), want[i], "matrix " + std::to_string(i), 1e-6);
}

// Shard(0) and Shard(1) matrices (uneven too) go through owners; a replicated one is gathered.
TEST(Muon, DistributedMatchesSingleDevice) {
  const auto want = single_device(0.02);
  run(4, [&](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {4}, {"dp"});
    const std::vector<Placements> layouts = {{Shard(0)}, {Shard(1)}, {Shard(0)}, {Replicate()}};
    std::vector<at::Tensor> params;
    for (size_t i = 0; i < kShapes.size(); ++i)
      params.push_back(distribute_tensor(initial(i), mesh, layouts[i]).requires_grad_(true));
    Muon muon(params, MuonOptions(0.02));
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < params.size(); ++i)
        params[i].mutable_grad() = distribute_tensor(gradient(i, step), mesh, layouts[i]);
      comm::CommDebugMode comm;
      muon.step();
      EXPECT_EQ(comm.count("all_to_all"), 2);  // pieces to their owners and back, for all matrices at once
      EXPECT_EQ(comm.count("all_gather"), 0);  // no matrix is gathered whole on every rank
    }
    for (size_t i = 0; i < params.size(); ++i)
      check_relative(DTensor(params[i]).full_tensor().detach(), want[i].detach(), "matrix " + std::to_string(i), 1e-6);
  });
}

TEST(Muon, RefusesNonMatrices) {
  expect_error([] { Muon({torch::zeros({3}, torch::requires_grad())}); }, {"matrices only", "[3]", "AdamW"});
}

}  // namespace
}  // namespace hp::test
