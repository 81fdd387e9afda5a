// Per-rank peak memory of an FSDP training step (allocator counters) stays within 1.15 x a bound
// built from parts that owe nothing to the peaks being checked:
// - 16 bytes x parameters / N: each rank's fp32 parameter, gradient and AdamW moment shards;
// - the unsharded parameters of the two largest units (the one computing and the one prefetched)
//   and the unsharded gradients of the largest (before its reduce-scatter), fp32;
// - the activations: what a single-device forward (model and loss) leaves allocated for its
//   backward, measured on its own;
// - the loss's backward working set: the softmax of the logits and its gradient, fp32.
// The no-FSDP peak is printed beside it.
#include <hp/core/memory_tracker.h>
#include <hp/nn/init.h>
#include <hp/parallel/fsdp.h>
#include <hp/parallel/loss_parallel.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <map>

#include "test_util.h"
#include "tp/llama_model.h"

namespace hp::test {
namespace {

LlamaConfig config() {
  LlamaConfig c;
  c.vocab = 512;
  c.dim = 64;
  c.layers = 4;
  c.ffn_hidden = 192;
  return c;
}

constexpr int64_t kBatch = 2, kSeq = 16;

// Peak bytes this rank allocates from building the model through 3 training steps.
int64_t peak_of_training(const DeviceMesh* dp, FullyShardOptions options = {}) {
  MemoryTracker tracker;
  Llama model(config());
  if (dp)  // torchtitan's units: each block, the embedding, the LM head, then the root (final norm)
    for (const char* unit : {"layers.*", "embed", "output", ""})
      for (auto& [fqn, m] : nn::match_modules(model, unit)) fully_shard(*m, *dp, options);
  nn::init_parameters(model, 1);
  torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-3));
  const at::Tensor seq = at::randint(0, config().vocab, {kBatch, kSeq + 1}, at::make_generator<at::CPUGeneratorImpl>(2),
                                     at::TensorOptions().dtype(at::kLong));
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    cross_entropy(model(seq.narrow(1, 0, kSeq)), seq.narrow(1, 1, kSeq)).backward();
    optimizer.step();
  }
  return tracker.peak();
}

// What a single-device forward (model and loss) leaves allocated for its backward, measured on its
// own: the tensors autograd saved, the logits and the loss.
int64_t forward_activations() {
  Llama model(config());
  nn::init_parameters(model, 1);
  const at::Tensor seq = at::randint(0, config().vocab, {kBatch, kSeq + 1}, at::make_generator<at::CPUGeneratorImpl>(2),
                                     at::TensorOptions().dtype(at::kLong));
  MemoryTracker tracker;
  const at::Tensor loss = cross_entropy(model(seq.narrow(1, 0, kSeq)), seq.narrow(1, 1, kSeq));
  return tracker.current();
}

TEST(FsdpMemory, PeakWithinTheBound) {
  Llama reference(config());
  int64_t params = 0;
  std::map<std::string, int64_t> units;  // unit -> parameters (blocks, embed, output, root = norm)
  for (const auto& item : reference.named_parameters()) {
    params += item.value().numel();
    const std::string& fqn = item.key();
    units[fqn.rfind("layers.", 0) == 0 ? fqn.substr(0, fqn.find('.', 7)) : fqn.substr(0, fqn.find('.'))] +=
        item.value().numel();
  }
  std::vector<int64_t> sizes;
  for (const auto& [unit, n] : units) sizes.push_back(n);
  std::sort(sizes.rbegin(), sizes.rend());
  // Two units' unsharded parameters and the largest's unsharded gradients, fp32.
  const int64_t unsharded = 4 * (sizes[0] + sizes[1]) + 4 * sizes[0];
  const int64_t activations = forward_activations();
  const int64_t loss_backward = 2 * 4 * kBatch * kSeq * config().vocab;
  const int64_t no_fsdp = peak_of_training(nullptr);
  std::printf("%-8s %14s %14s %8s\n", "ranks", "peak bytes", "bound", "ratio");
  std::printf("%-8s %14ld %14s %8s   (parameters %ld, activations %ld B)\n", "no FSDP", no_fsdp, "-", "-", params,
              activations);
  for (int n : {2, 4}) {
    run(n, [&](const comm::ProcessGroup& g) {
      DeviceMesh dp = init_device_mesh(g, "cpu", {n}, {"dp"});
      const int64_t peak = peak_of_training(&dp);
      const double bound = 1.15 * (16.0 * params / n + unsharded + activations + loss_backward);
      if (g.rank() == 0) std::printf("%-8d %14ld %14.0f %8.2f\n", n, peak, bound, peak / bound);
      EXPECT_LE(peak, bound) << "rank " << g.rank() << " of " << n;
    });
  }
}

// ZeRO-1 keeps whole parameters and gradients, ZeRO-2 whole parameters, ZeRO-3 neither: measured
// per-rank peaks order accordingly.
TEST(FsdpMemory, LevelsOrderZero1AboveZero2AboveZero3) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh dp = init_device_mesh(g, "cpu", {2}, {"dp"});
    std::vector<int64_t> peaks;
    for (ShardingLevel level : {ShardingLevel::kOptimizer, ShardingLevel::kGradients, ShardingLevel::kParameters}) {
      FullyShardOptions options;
      options.level = level;
      peaks.push_back(peak_of_training(&dp, options));
    }
    if (g.rank() == 0)
      std::printf("peak bytes per rank on 2 ranks: ZeRO-1 %ld, ZeRO-2 %ld, ZeRO-3 %ld\n", peaks[0], peaks[1], peaks[2]);
    EXPECT_GT(peaks[0], peaks[1]);
    EXPECT_GT(peaks[1], peaks[2]);
  });
}

}  // namespace
}  // namespace hp::test
