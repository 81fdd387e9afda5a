// clip_grad_norm_ over sharded gradients equals the 2-norm of the single-device gradients, computed
// by its formula in double (within 1e-6 relative), for tensor-parallel (plain replicated norms; with
// SP replicated DTensors), FSDP and FSDP x TP placements, and clipping brings the global norm to
// max_norm. Under a deterministic world the norm is the same bits for every split.
#include <algorithm>
#include <limits>

#include <ATen/ATen.h>
#include <hp/core/exact_square_sum.h>
#include <hp/dtensor/dtensor.h>
#include <hp/nn/init.h>
#include <hp/optim/clip_grad.h>
#include <hp/parallel/fsdp.h>
#include <hp/parallel/loss_parallel.h>

#include "test_util.h"
#include "tp/llama_model.h"
#include "tp/llama_plan.h"

namespace hp::test {
namespace {

std::pair<at::Tensor, at::Tensor> batch(int64_t first, int64_t count) {
  const at::Tensor all = at::randint(0, LlamaConfig{}.vocab, {4, 9}, at::make_generator<at::CPUGeneratorImpl>(8),
                                     at::TensorOptions().dtype(at::kLong));
  const at::Tensor mine = all.narrow(0, first, count);
  return {mine.narrow(1, 0, 8).contiguous(), mine.narrow(1, 1, 8).contiguous()};
}

double single_device_norm() {
  static const double norm = [] {
    double n = 0;
    run(1, [&](const comm::ProcessGroup& g) {
      Llama model(LlamaConfig{});
      nn::init_parameters(model, 4);
      auto [tokens, targets] = batch(0, 4);
      cross_entropy(model(tokens), targets).backward();
      double squares = 0.0;  // the 2-norm by its formula, not by the function under test
      for (const at::Tensor& p : model.parameters()) squares += p.grad().to(at::kDouble).pow(2).sum().item<double>();
      n = std::sqrt(squares);
    });
    return n;
  }();
  return norm;
}

struct Layout {
  std::string name;
  int tp = 1, dp = 1;
  bool sequence_parallel = false;
};

class ClipGradNorm : public ::testing::TestWithParam<Layout> {};

TEST_P(ClipGradNorm, EqualsSingleDeviceAndClips) {
  const Layout l = GetParam();
  const double want = single_device_norm();
  run(l.tp * l.dp, [&](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {l.dp, l.tp}, {"dp", "tp"});
    Llama model(LlamaConfig{});
    if (l.tp > 1) parallelize_module(model, mesh["tp"], llama_tp_plan({l.sequence_parallel, false}));
    if (l.dp > 1) {
      for (const char* unit : {"layers.*", ""})
        for (auto& [fqn, m] : nn::match_modules(model, unit)) fully_shard(*m, mesh["dp"]);
    }
    nn::init_parameters(model, 4);
    const int64_t per_rank = 4 / l.dp;
    auto [tokens, targets] = batch(mesh.get_local_rank("dp") * per_rank, per_rank);
    cross_entropy(model(tokens), targets).backward();
    const double got = clip_grad_norm_(model.parameters(), want / 2, g);
    EXPECT_NEAR(got, want, 1e-6 * want) << l.name;
    const double after = clip_grad_norm_(model.parameters(), 1e9, g);
    EXPECT_NEAR(after, want / 2, 1e-6 * want) << l.name << ": clipped norm";
  });
}

// The infinity norm over FSDP x TP shards is the largest |gradient| of the gathered model, exactly.
TEST(ClipGradNorm, InfinityNormIsTheLargestGradientOverShards) {
  run(4, [&](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2, 2}, {"dp", "tp"});
    Llama model(LlamaConfig{});
    parallelize_module(model, mesh["tp"], llama_tp_plan({false, false}));
    for (const char* unit : {"layers.*", ""})
      for (auto& [fqn, m] : nn::match_modules(model, unit)) fully_shard(*m, mesh["dp"]);
    nn::init_parameters(model, 4);
    auto [tokens, targets] = batch(mesh.get_local_rank("dp") * 2, 2);
    cross_entropy(model(tokens), targets).backward();
    double want = 0.0;
    for (const at::Tensor& p : model.parameters())
      want = std::max(want, test::whole(p.grad()).abs().max().item<double>());
    EXPECT_EQ(clip_grad_norm_(model.parameters(), 1e9, g, std::numeric_limits<double>::infinity()), want);
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClipGradNorm,
                         ::testing::Values(Layout{"tp2", 2, 1, false}, Layout{"tp2_sp", 2, 1, true},
                                           Layout{"fsdp2", 1, 2}, Layout{"fsdp4", 1, 4},
                                           Layout{"fsdp2_tp2_sp", 2, 2, true}, Layout{"fsdp2_tp2", 2, 2, false}),
                         [](const auto& info) { return info.param.name; });

// With a deterministic world group the norm is exact: the same bits however the gradients are
// split over ranks (FSDP rows over 1, 2 or 4 ranks, HSDP, TP columns), namely the square root of
// the exact sum of squares of the whole gradients.
TEST(ClipGradNorm, DeterministicWorldGivesTheSameBitsForEveryLayout) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  std::vector<at::Tensor> grads;
  // 300,000 squares of similar size: summed in double, the split over 2 ranks rounds otherwise.
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{7, 6}, {1000, 300}, {5}, {777, 123}})
    grads.push_back(at::randn(shape, gen) * at::exp2(at::randint(0, 2, shape, gen).to(at::kFloat)));
  ExactSquareSum whole;
  for (const at::Tensor& g : grads) whole.add(g);
  const double want = std::sqrt(whole.value());

  struct Split {
    std::string name;
    std::vector<int64_t> shape;  // mesh ("a", "b"): b shards rows, a shards columns or replicates
    bool columns_on_a;
  };
  testing::RunRanksOptions deterministic;
  deterministic.group.set_deterministic(true);
  for (const Split& split :
       {Split{"rows over 1", {1, 1}, false}, Split{"rows over 2", {1, 2}, false}, Split{"rows over 4", {1, 4}, false},
        Split{"replicated x rows", {2, 2}, false}, Split{"columns x rows", {2, 2}, true}})
    run(
        static_cast<int>(split.shape[0] * split.shape[1]),
        [&](const comm::ProcessGroup& g) {
          const DeviceMesh mesh = init_device_mesh(g, "cpu", split.shape, {"a", "b"});
          std::vector<at::Tensor> params;
          for (const at::Tensor& grad : grads) {
            const bool columns = split.columns_on_a && grad.dim() == 2;
            const Placements placements = {columns ? Placement(Shard(1)) : Placement(Replicate()), Shard(0)};
            at::Tensor p = distribute_tensor(at::zeros_like(grad), mesh, placements);
            p.mutable_grad() = distribute_tensor(grad, mesh, placements);
            params.push_back(p);
          }
          EXPECT_EQ(clip_grad_norm_(params, 1e9, g), want) << split.name;
        },
        deterministic);
  double squares = 0.0;
  for (const at::Tensor& g : grads) squares += g.to(at::kDouble).pow(2).sum().item<double>();
  EXPECT_NEAR(want, std::sqrt(squares), 1e-12 * want);
}

TEST(ClipGradNormErrors, BadArguments) {
  run(1, [](const comm::ProcessGroup& g) {
    std::vector<at::Tensor> none;
    expect_error([&] { clip_grad_norm_(none, 1.0, g, 1.0); }, "norm_type must be 2 or infinity");
    expect_error([&] { clip_grad_norm_(none, -1.0, g); }, "max_norm must be non-negative");
  });
}

}  // namespace
}  // namespace hp::test
