// Activation swap (hp/parallel/activation_swap.h), on the host and the file tier: what leaves the
// compute allocator is exactly what the tier received, the tier empties after backward, prefetching
// reloads ahead of need (counted with the deterministic copy engine), gradients are bitwise those
// without swapping, and the file tier leaves no file and fails by name.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "hp/core/op_counter.h"
#include "hp/nn/init.h"
#include "hp/nn/layers.h"
#include "hp/parallel/activation_swap.h"
#include "hp/parallel/checkpoint.h"
#include "parallel/swap_tier.h"
#include "scoped_file_size_limit.h"
#include "scratch_dir.h"
#include "test_util.h"

namespace hp::test {
namespace {

constexpr int64_t kWidth = 512;
constexpr int64_t kMatrixBytes = kWidth * kWidth * 4;
constexpr int kBlocks = 4;

// Four blocks of two 512-wide linears.
std::shared_ptr<nn::Sequential> blocks() {
  auto model = std::make_shared<nn::Sequential>();
  for (int b = 0; b < kBlocks; ++b) {
    auto block = std::make_shared<nn::Sequential>();
    block->push_back(std::make_shared<nn::Linear>(kWidth, kWidth));
    block->push_back(std::make_shared<nn::Linear>(kWidth, kWidth));
    model->push_back(block);
  }
  nn::init_parameters(*model, 21);
  return model;
}

struct Measured {
  int64_t bytes_after_forward = 0;
  SwapStats after_forward, after_backward;
  OpCounter backward;
  std::map<std::string, at::Tensor> grads;
};

Measured train(nn::Module& model, const std::shared_ptr<SwapManager>& swap) {
  const at::Tensor x = at::randn({kWidth, kWidth}, at::make_generator<at::CPUGeneratorImpl>(4));
  Measured m;
  at::Tensor out;
  {
    MemoryTracker tracker;
    out = model(x);
    m.bytes_after_forward = tracker.current();
  }
  if (swap) m.after_forward = swap->stats();
  {
    DispatchModeGuard on(m.backward);
    out.pow(2).mean().backward();
  }
  if (swap) m.after_backward = swap->stats();
  for (const auto& item : model.named_parameters()) m.grads[item.key()] = item.value().grad().clone();
  return m;
}

std::shared_ptr<nn::Sequential> swapped_blocks(const std::shared_ptr<SwapManager>& swap) {
  auto model = blocks();
  for (auto& [fqn, block] : nn::match_modules(*model, "*")) checkpoint(*block, {default_swap_policy, swap});
  return model;
}

// The host tier, or the file tier in a scratch directory.
SwapOptions on_tier(SwapOptions::Tier tier, SwapOptions options = {}) {
  options.tier = tier;
  if (tier == SwapOptions::Tier::kFile) options.directory = scratch_dir("activation_swap");
  return options;
}

const char* tier_name(SwapOptions::Tier tier) { return tier == SwapOptions::Tier::kFile ? "file" : "host"; }

// Each block keeps its two products' outputs. Its second is its output, which the next block holds
// as its input, so it stays; the last block's forward stays resident for the backward that starts
// with it. That leaves the first product of blocks 0, 1 and 2 for the tier.
TEST(ActivationSwap, ComputeBytesSavedAreTheBytesSwappedAndBackwardRecomputesNoProduct) {
  auto plain_model = blocks();
  const Measured plain = train(*plain_model, nullptr);
  EXPECT_EQ(plain.bytes_after_forward, 2 * kBlocks * kMatrixBytes);
  for (const SwapOptions::Tier tier : {SwapOptions::Tier::kHost, SwapOptions::Tier::kFile})
    for (const int prefetch : {1, 0}) {
      auto swap = std::make_shared<SwapManager>(on_tier(tier, {prefetch, 64 * 1024, /*inline_copies=*/true}));
      auto model = swapped_blocks(swap);
      const Measured m = train(*model, swap);
      const std::string what = std::string(tier_name(tier)) + " tier, prefetch " + std::to_string(prefetch);
      EXPECT_EQ(m.after_forward.swapped_bytes, (kBlocks - 1) * kMatrixBytes) << what;
      EXPECT_EQ(m.bytes_after_forward, plain.bytes_after_forward - m.after_forward.swapped_bytes) << what;
      EXPECT_EQ(m.after_forward.pool_in_use, m.after_forward.swapped_bytes) << what;
      EXPECT_EQ(m.after_backward.pool_in_use, 0) << what;
      EXPECT_EQ(m.after_backward.reloaded_bytes, m.after_forward.swapped_bytes) << what;
      // With prefetch 1 each block's reload starts when the backward of the block after it does; with
      // none, each swapped block waits for its own.
      EXPECT_EQ(m.after_backward.reload_waits, prefetch == 0 ? kBlocks - 1 : 0) << what;
      EXPECT_EQ(m.backward.count("aten::addmm"), 0) << what;
      EXPECT_EQ(m.backward.count("aten::mm"), plain.backward.count("aten::mm")) << what;
      for (const auto& [name, grad] : plain.grads) check_close(m.grads.at(name), grad, what + ": " + name, true);
    }
}

// With hp::checkpoint_modules a swapped block's outputs leave when the next block's forward ends,
// whether that block swaps or not: block 0 alone swapped, before a plain block, sends its first
// product away (the compute allocator holds exactly that less after forward; a fully checkpointed
// block 1 drops its own first product on top); the last block swapped alone keeps its outputs, as
// its backward comes first. The block after the swapped one starts its reload from its own
// backward (plain) or recomputation (checkpointed): with prefetch 1 backward never waits for it,
// with 0 it waits once. Gradients bitwise those without swapping; the pool empty after backward.
TEST(ActivationSwap, AnyLaterBlockSendsASwappedBlocksOutputsAway) {
  auto plain_model = blocks();
  const Measured plain = train(*plain_model, nullptr);
  using M = CheckpointMode;
  struct Case {
    std::vector<M> modes;
    int64_t matrices_less;  // than plain training holds after forward; -1: not derived here
    int64_t left;           // regions sent away
  };
  for (const Case& c :
       {Case{{M::kSwap, M::kNone, M::kNone, M::kNone}, 1, 1}, Case{{M::kSwap, M::kFull, M::kNone, M::kNone}, 2, 1},
        Case{{M::kSwap, M::kSelective, M::kNone, M::kNone}, -1, 1},
        Case{{M::kSwap, M::kNone, M::kSwap, M::kNone}, 2, 2}, Case{{M::kNone, M::kNone, M::kNone, M::kSwap}, 0, 0}})
    for (const int prefetch : {1, 0}) {
      auto model = blocks();
      const auto regions = checkpoint_modules(*model, "*", c.modes, {prefetch, 64 * 1024, /*inline_copies=*/true});
      std::shared_ptr<SwapManager> swap;
      for (const auto& [fqn, region] : regions)
        if (region.swap()) swap = region.swap();
      ASSERT_NE(swap, nullptr);
      const Measured m = train(*model, swap);
      std::string what = "prefetch " + std::to_string(prefetch) + ", blocks";
      for (M mode : c.modes) what += std::string(" ") + checkpoint_mode_name(mode);
      if (c.matrices_less >= 0)
        EXPECT_EQ(m.bytes_after_forward, plain.bytes_after_forward - c.matrices_less * kMatrixBytes) << what;
      EXPECT_EQ(m.after_forward.swapped_bytes, c.left * kMatrixBytes) << what;
      EXPECT_EQ(m.after_backward.reload_waits, prefetch == 0 ? c.left : 0) << what;
      EXPECT_EQ(m.after_backward.pool_in_use, 0) << what;
      for (const auto& [name, grad] : plain.grads) check_close(m.grads.at(name), grad, what + ": " + name, true);
    }
}

// Two micro-batches forward, then both backward in the order of their forwards (a GPipe stage's
// order): the block after the swapped one starts each micro-batch's reload from its own backward,
// a checkpointed block's recomputation taking the swapped regions first in, first out. So with
// prefetch 1 no backward waits for a reload; with 0 each swapped region waits once. Gradients
// bitwise those of the same two micro-batches without swapping.
TEST(ActivationSwap, MicroBatchesForwardThenBackwardInOrderWaitForNoReload) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
  const std::vector<at::Tensor> inputs = {at::randn({kWidth, kWidth}, gen), at::randn({kWidth, kWidth}, gen)};
  const auto forward_forward_backward_backward = [&](nn::Module& model) {
    std::vector<at::Tensor> losses;
    for (const at::Tensor& x : inputs) losses.push_back(model(x).pow(2).mean());
    for (const at::Tensor& loss : losses) loss.backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& item : model.named_parameters()) grads[item.key()] = item.value().grad().clone();
    return grads;
  };
  auto plain_model = blocks();
  const std::map<std::string, at::Tensor> plain = forward_forward_backward_backward(*plain_model);
  using M = CheckpointMode;
  for (const std::vector<M>& modes : {std::vector<M>{M::kSwap, M::kFull, M::kNone, M::kNone},
                                      std::vector<M>{M::kSwap, M::kSelective, M::kNone, M::kNone},
                                      std::vector<M>{M::kSwap, M::kNone, M::kNone, M::kNone}})
    for (const int prefetch : {1, 0}) {
      auto model = blocks();
      const auto regions = checkpoint_modules(*model, "*", modes, {prefetch, 64 * 1024, /*inline_copies=*/true});
      const std::shared_ptr<SwapManager> swap = regions.front().second.swap();
      const std::map<std::string, at::Tensor> grads = forward_forward_backward_backward(*model);
      std::string what = "prefetch " + std::to_string(prefetch) + ", blocks";
      for (M mode : modes) what += std::string(" ") + checkpoint_mode_name(mode);
      const SwapStats stats = swap->stats();
      EXPECT_EQ(stats.swapped_bytes, 2 * kMatrixBytes) << what << ": one region per micro-batch";
      EXPECT_EQ(stats.reloaded_bytes, stats.swapped_bytes) << what;
      EXPECT_EQ(stats.reload_waits, prefetch == 0 ? 2 : 0) << what;
      EXPECT_EQ(stats.pool_in_use, 0) << what;
      for (const auto& [name, grad] : plain) check_close(grads.at(name), grad, what + ": " + name, true);
    }
}

// The real copy thread: the same gradients, the pool empty after backward, its buffers reused by
// the next step (none allocated after the first).
TEST(ActivationSwap, TheCopyThreadGivesTheSameGradientsAndReusesItsBuffers) {
  auto plain_model = blocks();
  const Measured plain = train(*plain_model, nullptr);
  for (const SwapOptions::Tier tier : {SwapOptions::Tier::kHost, SwapOptions::Tier::kFile}) {
    const std::string what = tier_name(tier);
    auto swap = std::make_shared<SwapManager>(on_tier(tier));
    auto model = swapped_blocks(swap);
    const Measured first = train(*model, swap);
    for (const auto& [name, grad] : plain.grads) check_close(first.grads.at(name), grad, what + ": " + name, true);
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    const Measured second = train(*model, swap);
    EXPECT_EQ(second.after_backward.pool_in_use, 0) << what;
    EXPECT_EQ(second.after_backward.pool_held, first.after_backward.pool_held) << what;
    EXPECT_EQ(second.after_backward.swapped_bytes, 2 * first.after_backward.swapped_bytes) << what;
    for (const auto& [name, grad] : plain.grads) check_close(second.grads.at(name), grad, what + ": " + name, true);
  }
}

// The file tier's file has no name: the directory holds nothing, during the step or after it.
TEST(ActivationSwap, TheFileTierLeavesNothingInItsDirectory) {
  const SwapOptions options = on_tier(SwapOptions::Tier::kFile);
  const auto entries = [&] {
    return std::distance(std::filesystem::directory_iterator(options.directory), std::filesystem::directory_iterator());
  };
  {
    auto swap = std::make_shared<SwapManager>(options);
    auto model = swapped_blocks(swap);
    const at::Tensor out = (*model)(at::ones({kWidth, kWidth}));
    EXPECT_GT(swap->stats().pool_in_use, 0);
    EXPECT_EQ(entries(), 0);
    out.sum().backward();
  }
  EXPECT_EQ(entries(), 0);
}

// The descriptor of the tier's unnamed file in `dir`, found in /proc/self/fd (its link reads
// "<dir>/#<inode> (deleted)", or "<dir>/hp-swap-... (deleted)"), or -1.
int unnamed_file_in(const std::string& dir) {
  const std::string deleted = " (deleted)";
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const std::string target = std::filesystem::read_symlink(entry.path(), error).string();
    if (!error && target.rfind(dir + "/", 0) == 0 && target.size() > deleted.size() &&
        target.compare(target.size() - deleted.size(), deleted.size(), deleted) == 0)
      return std::stoi(entry.path().filename().string());
  }
  return -1;
}

// The file tier's pages do not stay in the page cache: after a write (written back, then dropped)
// and after a read, none of the buffer's pages is cached (mincore on a mapping of the file).
TEST(ActivationSwap, TheFileTierLeavesNoPageInThePageCache) {
  const SwapOptions options = on_tier(SwapOptions::Tier::kFile);
  if (detail::on_memory_file_system(options.directory))
    GTEST_SKIP() << options.directory << " is a tmpfs or ramfs: its files are memory";
  const std::unique_ptr<detail::SwapTier> tier = detail::make_swap_tier(options);
  const int64_t bytes = int64_t{8} << 20;
  detail::SwapTier::Buffer buffer = tier->acquire(bytes);
  const int fd = unnamed_file_in(options.directory);
  ASSERT_GE(fd, 0) << "no unnamed file in " << options.directory;
  const int64_t page = sysconf(_SC_PAGESIZE);
  const auto cached_pages = [&] {
    void* mapped = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, buffer.offset);
    EXPECT_NE(mapped, MAP_FAILED);
    std::vector<unsigned char> resident((bytes + page - 1) / page);
    EXPECT_EQ(mincore(mapped, bytes, resident.data()), 0);
    munmap(mapped, bytes);
    return std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) != 0; });
  };
  const std::vector<uint8_t> data(bytes, 7);
  tier->write(buffer, data.data());
  EXPECT_EQ(cached_pages(), 0) << "after the write";
  std::vector<uint8_t> back(bytes);
  tier->read(buffer, back.data());
  EXPECT_EQ(back, data);
  EXPECT_EQ(cached_pages(), 0) << "after the read";
  tier->release(buffer);
}

// A directory that cannot hold the file fails when the manager is made; a tier that runs out of
// space fails the forward that needed it, by name, and the step can be dropped cleanly.
TEST(ActivationSwap, FileTierFailuresAreErrorsThatSayWhy) {
  const std::string under_a_file = scratch_dir("activation_swap_bad") + "/a_file";
  std::ofstream(under_a_file) << "not a directory";
  SwapOptions nowhere = on_tier(SwapOptions::Tier::kFile);
  nowhere.directory = under_a_file + "/swap";
  expect_error([&] { SwapManager manager(nowhere); }, "cannot create the file tier's file in '" + nowhere.directory);
  auto swap = std::make_shared<SwapManager>(on_tier(SwapOptions::Tier::kFile, {1, 64 * 1024, /*inline_copies=*/true}));
  auto model = swapped_blocks(swap);
  {
    ScopedFileSizeLimit no_room(kMatrixBytes / 2);
    expect_error([&] { (*model)(at::ones({kWidth, kWidth})); }, "cannot reserve 1048576 bytes for the file tier");
  }
  const Measured m = train(*model, swap);  // room again: the next step swaps as before
  EXPECT_EQ(m.after_forward.swapped_bytes, (kBlocks - 1) * kMatrixBytes);
  EXPECT_EQ(m.after_backward.pool_in_use, 0);
}

// A write that fails on the copy thread (past a file size limit set after the first step had
// reserved the file's space) fails the next forward, once, saying why; nothing stays in the tier,
// and the next step swaps and computes as before.
TEST(ActivationSwap, AFailedCopyFailsTheNextForwardOnce) {
  auto plain_model = blocks();
  const Measured plain = train(*plain_model, nullptr);
  auto swap = std::make_shared<SwapManager>(on_tier(SwapOptions::Tier::kFile, {1, 64 * 1024, /*inline_copies=*/true}));
  auto model = swapped_blocks(swap);
  train(*model, swap);
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  {
    ScopedFileSizeLimit short_of_room(kMatrixBytes / 2);
    expect_error(
        [&] {
          (*model)(at::ones({kWidth, kWidth})).sum().backward();
        },
        "activation swap: a copy on the copy thread failed: activation swap: writing 1048576 bytes to the "
        "file tier");
  }
  EXPECT_EQ(swap->stats().pool_in_use, 0);
  const Measured again = train(*model, swap);
  EXPECT_EQ(again.after_forward.pool_in_use, (kBlocks - 1) * kMatrixBytes);
  for (const auto& [name, grad] : plain.grads) check_close(again.grads.at(name), grad, name, true);
}

TEST(ActivationSwap, ASwapDecisionNeedsAManagerAndAManagerAPolicy) {
  auto model = blocks();
  expect_error([&] { checkpoint(*model, {nullptr, std::make_shared<SwapManager>()}); }, "no policy");
  checkpoint(*model, {default_swap_policy, nullptr});
  expect_error([&] { (*model)(at::ones({2, kWidth})).sum().backward(); }, "has no SwapManager");
}

}  // namespace
}  // namespace hp::test
