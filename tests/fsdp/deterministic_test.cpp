// Deterministic mode makes FSDP training independent of the data-parallel degree: at a fixed
// micro-batch size (1 sequence) and global batch (4 sequences), dp = 1 (accumulating 4
// micro-batches), dp = 2 (2 each) and dp = 4 (1 each) give bitwise identical losses and parameters
// over 5 AdamW steps of the test transformer. Micro-batch gradients are summed in one binary tree
// over the global micro-batch index, locally and then across ranks; scalings are powers of two.
#include <hp/comm/tree_reduce.h>
#include <hp/dtensor/dtensor.h>
#include <hp/nn/init.h>
#include <hp/parallel/fsdp.h>
#include <hp/parallel/loss_parallel.h>
#include <torch/optim/adamw.h>

#include "test_util.h"
#include "tp/llama_model.h"

namespace hp::test {
namespace {

constexpr int kSteps = 5, kGlobalBatch = 4;

struct Trace {
  std::vector<at::Tensor> losses;
  std::map<std::string, at::Tensor> params;
};

at::Tensor sequence(int step, int index) {
  return at::randint(0, LlamaConfig{}.vocab, {1, 9}, at::make_generator<at::CPUGeneratorImpl>(1000 * step + index),
                     at::TensorOptions().dtype(at::kLong));
}

Trace train(int dp) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(20)).set_deterministic(true);
  options.cpu_threads_per_rank = 1;  // ATen's reductions split work by thread count: keep it fixed
  Trace trace;
  run(
      dp,
      [&](const comm::ProcessGroup& g) {
        DeviceMesh mesh = init_device_mesh(g, "cpu", {dp}, {"dp"});
        Llama model(LlamaConfig{});
        std::vector<FSDPModule> units;
        for (auto& [fqn, block] : nn::match_modules(model, "layers.*")) units.push_back(fully_shard(*block, mesh));
        units.push_back(fully_shard(model, mesh));
        nn::init_parameters(model, 3);
        torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-2));
        const int micro = kGlobalBatch / dp;
        for (int step = 0; step < kSteps; ++step) {
          optimizer.zero_grad();
          std::vector<at::Tensor> losses;
          for (int m = 0; m < micro; ++m) {
            for (auto& u : units) u.set_requires_gradient_sync(m == micro - 1);
            const at::Tensor seq = sequence(step, g.rank() * micro + m);
            at::Tensor loss = cross_entropy(model(seq.narrow(1, 0, 8)), seq.narrow(1, 1, 8));
            (loss / static_cast<double>(micro)).backward();
            losses.push_back(loss.detach());
          }
          // The global mean in the same tree: this rank's micro-batches, then across ranks.
          const at::Tensor mine = comm::tree_reduce(at::stack(losses), comm::ReduceOp::kSum);
          const at::Tensor global = g.all_reduce(mine.clone()) / static_cast<double>(kGlobalBatch);
          if (g.rank() == 0) trace.losses.push_back(global);
          optimizer.step();
        }
        for (const auto& item : model.named_parameters()) {
          const at::Tensor full = DTensor(item.value()).full_tensor().detach();
          if (g.rank() == 0) trace.params[item.key()] = full;
        }
      },
      options);
  return trace;
}

TEST(DeterministicFsdp, DataParallelDegreeDoesNotChangeOneBit) {
  const Trace one = train(1), two = train(2), four = train(4);
  for (int step = 0; step < kSteps; ++step) {
    check_close(two.losses[step], one.losses[step], "loss at step " + std::to_string(step) + ", dp 2 vs 1",
                /*bitwise=*/true);
    check_close(four.losses[step], one.losses[step], "loss at step " + std::to_string(step) + ", dp 4 vs 1",
                /*bitwise=*/true);
  }
  for (const auto& [fqn, p] : one.params) {
    check_close(two.params.at(fqn), p, fqn + ", dp 2 vs 1", /*bitwise=*/true);
    check_close(four.params.at(fqn), p, fqn + ", dp 4 vs 1", /*bitwise=*/true);
  }
  EXPECT_FALSE(at::equal(one.losses.front(), one.losses.back()));  // it did train
}

}  // namespace
}  // namespace hp::test
