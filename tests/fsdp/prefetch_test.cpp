// hp::set_prefetch_depth: how far ahead along a chain of blocks each FSDP unit issues the gathers
// of the units that run next, counted with CommDebugMode where each block starts its forward and
// its backward, against the count derived from the depth; every depth gives the same gradients.
#include <hp/comm/comm_debug_mode.h>
#include <hp/nn/init.h>
#include <hp/nn/layers.h>
#include <hp/parallel/fsdp.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "test_util.h"

namespace hp::test {
namespace {

constexpr int kBlocks = 4;

// A root of kBlocks blocks and a head. Block k is Sequential{Linear, Linear}, both 8 x 8: its
// second Linear is in the block's own unit, its first is a unit of its own inside the block (as a
// MoE block's experts). The root's own unit holds the head.
struct Chain {
  std::shared_ptr<nn::Sequential> root = std::make_shared<nn::Sequential>();
  std::vector<nn::Module*> blocks;

  explicit Chain(const DeviceMesh& mesh) {
    for (int k = 0; k < kBlocks; ++k) {
      auto block = std::make_shared<nn::Sequential>();
      block->push_back(std::make_shared<nn::Linear>(8, 8));
      block->push_back(std::make_shared<nn::Linear>(8, 8));
      root->push_back(block);
      blocks.push_back(block.get());
    }
    root->push_back(std::make_shared<nn::Linear>(8, 8));
    for (nn::Module* block : blocks) {
      fully_shard((*static_cast<nn::Sequential*>(block))[0], mesh);
      fully_shard(*block, mesh);
    }
    fully_shard(*root, mesh);
    nn::init_parameters(*root, 5);
  }
};

struct Counts {
  std::vector<int64_t> forward, backward;  // gathers issued in that pass when block k starts it
  std::vector<int64_t> inner_backward;     // ... when block k's inner unit starts its backward
  std::map<std::string, at::Tensor> gradients;
};

// One forward and backward on this rank's data with prefetch `depth` (none: the default).
Counts run_chain(const comm::ProcessGroup& world, std::optional<int> depth) {
  Chain chain(init_device_mesh(world, "cpu", {world.size()}, {"dp"}));
  if (depth) set_prefetch_depth(*chain.root, chain.blocks, *depth);
  Counts counts;
  counts.forward.assign(kBlocks, -1);
  counts.backward.assign(kBlocks, -1);
  counts.inner_backward.assign(kBlocks, -1);
  comm::CommDebugMode comm;
  int64_t backward_start = 0;
  std::vector<nn::HookHandle> hooks;
  for (int k = 0; k < kBlocks; ++k) {
    auto& block = *static_cast<nn::Sequential*>(chain.blocks[k]);
    // Forward: once the block's units (its own, then the inner one) have their parameters.
    hooks.push_back(block[1].register_forward_pre_hook(
        [&, k](nn::Module&, nn::Inputs&) { counts.forward[k] = comm.count("all_gather"); }));
    // Backward: the output hooks of the block and of its inner unit, each behind FSDP's (registered
    // at fully_shard), which gathers the unit's parameters again (or takes its prefetched gather)
    // and issues its prefetches.
    const auto count_backward = [&](std::vector<int64_t>& into, int k) {
      return [&into, &comm, &backward_start, k](nn::Module&, const nn::Inputs&, at::Tensor& output) {
        output.register_hook([&into, &comm, &backward_start, k](const at::Tensor& grad) {
          into[k] = comm.count("all_gather") - backward_start;
          return grad;
        });
      };
    };
    hooks.push_back(block.register_forward_hook(count_backward(counts.backward, k)));
    hooks.push_back(block[0].register_forward_hook(count_backward(counts.inner_backward, k)));
  }
  const at::Tensor out = (*chain.root)(rank_data(world.rank(), {3, 8}, at::kFloat, 2));
  backward_start = comm.count("all_gather");
  out.square().sum().backward();
  for (const auto& item : chain.root->named_parameters()) counts.gradients[item.key()] = whole(item.value().grad());
  return counts;
}

// Depth d: when block k starts its forward, the root's gather, both units of blocks 0..k and both
// of the next min(d, kBlocks - 1 - k) blocks are issued. When block k starts its backward: the
// root's gather, both units of each later block, then block k's own unit and, with d > 0, its inner
// unit (prefetched with it) and both units of the previous min(d, k) blocks. With d = 0 the inner
// unit gathers later, at its own use: when its backward starts, one gather more has been issued;
// with d > 0 none (it takes its prefetched gather). The gradients are bitwise those of FSDP's default
// prefetching.
TEST(FsdpPrefetch, EachBlockGathersDepthBlocksAheadInForwardAndBackward) {
  run(2, [](const comm::ProcessGroup& world) {
    const Counts plain = run_chain(world, std::nullopt);
    for (int d : {0, 1, 2, 5}) {
      const Counts got = run_chain(world, d);
      for (int k = 0; k < kBlocks; ++k) {
        const int ahead = std::min(d, kBlocks - 1 - k), behind = std::min(d, k);
        EXPECT_EQ(got.forward[k], 1 + 2 * (k + 1) + 2 * ahead) << "depth " << d << ", forward of block " << k;
        EXPECT_EQ(got.backward[k], 1 + 2 * (kBlocks - 1 - k) + (d > 0 ? 2 : 1) + 2 * behind)
            << "depth " << d << ", backward of block " << k;
        EXPECT_EQ(got.inner_backward[k], got.backward[k] + (d > 0 ? 0 : 1))
            << "depth " << d << ", backward of block " << k << "'s inner unit";
      }
      for (const auto& [fqn, grad] : plain.gradients)
        check_close(got.gradients.at(fqn), grad, "depth " + std::to_string(d) + ": " + fqn, /*bitwise=*/true);
    }
    expect_error([&] { run_chain(world, -1); }, "depth -1 must be >= 0");
  });
}

}  // namespace
}  // namespace hp::test
