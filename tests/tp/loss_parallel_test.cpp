// Loss parallel: cross-entropy of vocabulary-sharded logits equals the single-device loss and
// logits gradient, and never needs more than ~1/TP of the memory of the whole logits (measured by
// the allocator).
#include <hp/core/memory_tracker.h>
#include <hp/dtensor/dtensor.h>
#include <hp/parallel/loss_parallel.h>
#include <torch/csrc/autograd/autograd.h>

#include "test_util.h"

namespace hp::test {
namespace {

constexpr int64_t kTokens = 32, kVocab = 4096;

at::Tensor logits_full() { return at::randn({2, kTokens / 2, kVocab}, at::make_generator<at::CPUGeneratorImpl>(5)); }
at::Tensor targets_full() {
  at::Tensor t = at::randint(0, kVocab, {2, kTokens / 2}, at::make_generator<at::CPUGeneratorImpl>(6),
                             at::TensorOptions().dtype(at::kLong));
  t[0][3] = -100;  // ignored
  return t;
}

// Peak bytes this rank allocates for the loss and the logits' gradient.
struct Result {
  int64_t peak = 0;
};

Result loss_parallel_on(const DeviceMesh& mesh) {
  const at::Tensor want_logits = logits_full().requires_grad_(true);
  const at::Tensor want = at::cross_entropy_loss(want_logits.reshape({-1, kVocab}), targets_full().reshape({-1}));
  want.backward();

  const at::Tensor logits = distribute_tensor(logits_full(), mesh, {Shard(2)}).requires_grad_(true);
  Result r;
  at::Tensor loss, grad;
  {
    MemoryTracker tracker;
    loss = cross_entropy(logits, targets_full());
    grad = torch::autograd::grad({loss}, {logits})[0];
    r.peak = tracker.peak();
  }
  check_close(DTensor(loss).full_tensor(), want.detach(), "loss on " + mesh.str());
  check_close(DTensor(grad).full_tensor(), want_logits.grad(), "logits gradient on " + mesh.str());
  return r;
}

TEST(LossParallel, MatchesSingleDeviceInAboutOneOverTpOfTheMemory) {
  const int64_t full_bytes = kTokens * kVocab * 4;
  int64_t peak_one_rank = 0;
  run(1, [&](const comm::ProcessGroup& g) {
    peak_one_rank = loss_parallel_on(init_device_mesh(g, "cpu", {1}, {"tp"})).peak;
  });
  std::cout << "whole logits " << full_bytes << " B; loss + grad peak on 1 rank " << peak_one_rank << " B\n";
  for (int tp : {2, 4}) {
    run(tp, [&](const comm::ProcessGroup& g) {
      const Result r = loss_parallel_on(init_device_mesh(g, "cpu", {tp}, {"tp"}));
      if (g.rank() == 0)
        std::cout << "TP=" << tp << ": peak " << r.peak << " B = " << double(r.peak) / peak_one_rank
                  << " of one rank's\n";
      // ~1/TP: the per-token vectors ([tokens] floats, a few KB) are the only part that does not shrink.
      EXPECT_LE(r.peak, peak_one_rank / tp + 16 * 1024) << "TP=" << tp;
    });
  }
}

TEST(LossParallel, TargetsOutOfShapeAndAllIgnoredAreErrors) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    const at::Tensor logits = distribute_tensor(at::zeros({4, 8}), mesh, {Shard(1)});
    expect_error([&] { cross_entropy(logits, at::zeros({3}, at::kLong)); }, {"targets have shape [3]", "[4, 8]"});
    expect_error([&] { cross_entropy(logits, at::full({4}, -100, at::kLong)); }, "every target equals ignore_index");
  });
}

}  // namespace
}  // namespace hp::test
