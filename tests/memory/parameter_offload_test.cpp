// Parameter offload (hp/parallel/offload.h): FSDP units whose shards, gradients and AdamW state live
// in a second tier train bitwise as without it on 2 and 4 ranks (host and file tier); the compute
// allocator holds none of those bytes (derived from the shapes) and its peak drops; the file tier
// keeps none of them in memory between uses; tensors moved into a tier keep their identity and values.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "hp/core/memory_timeline.h"
#include "hp/core/memory_tracker.h"
#include "hp/core/storage_tier.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"
#include "hp/nn/init.h"
#include "hp/optim/adamw.h"
#include "hp/parallel/fsdp.h"
#include "hp/parallel/loss_parallel.h"
#include "parallel/swap_tier.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "tp/llama_model.h"

namespace hp::test {
namespace {

constexpr int kSteps = 5;
constexpr int64_t kGlobalBatch = 4, kSeq = 8;

LlamaConfig config() {
  LlamaConfig c;
  c.vocab = 62;  // uneven shards: 16, 16, 16, 14 rows on 4 ranks
  c.ffn_hidden = 46;
  return c;
}

std::pair<at::Tensor, at::Tensor> batch(int step, int64_t first, int64_t count) {
  const at::Tensor all =
      at::randint(0, config().vocab, {kGlobalBatch, kSeq + 1}, at::make_generator<at::CPUGeneratorImpl>(70 + step),
                  at::TensorOptions().dtype(at::kLong));
  const at::Tensor mine = all.narrow(0, first, count);
  return {mine.narrow(1, 0, kSeq).contiguous(), mine.narrow(1, 1, kSeq).contiguous()};
}

// `owner`: a name of the caller's own among callers that run at once (thread-ranks), whose file
// tiers would otherwise empty each other's directory.
std::shared_ptr<ParameterOffload> offload_to(OffloadOptions::Tier tier, const std::string& owner = "") {
  OffloadOptions options;
  options.tier = tier;
  if (tier == OffloadOptions::Tier::kFile) options.directory = scratch_dir("parameter_offload" + owner);
  return std::make_shared<ParameterOffload>(options);
}

const char* tier_name(OffloadOptions::Tier tier) { return tier == OffloadOptions::Tier::kFile ? "file" : "host"; }

// The file tier refuses a copy-on-write file system (btrfs, ZFS): its tests skip where the temp
// directory is one.
bool file_tier_refused_here() {
  return detail::on_copy_on_write_file_system(std::filesystem::temp_directory_path().string());
}

// A Llama whose blocks and root are fully_shard units on `mesh`, offloaded to `offload` (or not).
std::unique_ptr<Llama> sharded_llama(const DeviceMesh& mesh, const std::shared_ptr<ParameterOffload>& offload) {
  auto model = std::make_unique<Llama>(config());
  FullyShardOptions options;
  options.offload = offload;
  for (auto& [fqn, block] : nn::match_modules(*model, "layers.*")) fully_shard(*block, mesh, options);
  fully_shard(*model, mesh, options);
  nn::init_parameters(*model, 5);
  return model;
}

// One step of rank `rank` of `dp`: the global mean loss.
double train_step(Llama& model, AdamW& optimizer, const DeviceMesh& mesh, int step, int dp, int rank) {
  optimizer.zero_grad();
  const int64_t per_rank = kGlobalBatch / dp;
  auto [tokens, targets] = batch(step, rank * per_rank, per_rank);
  at::Tensor loss = cross_entropy(model(tokens), targets);
  loss.backward();
  optimizer.step();
  return mesh.world().all_reduce(whole(loss).detach().clone(), {comm::ReduceOp::kAvg}).item<double>();
}

// The tensors a step leaves in the tier for `model`: each parameter's local shard, its gradient's
// and its AdamW moments'.
std::vector<at::Tensor> offloaded_tensors(Llama& model, AdamW& optimizer) {
  std::vector<at::Tensor> tensors;
  for (const at::Tensor& p : model.parameters()) {
    const auto& state = static_cast<torch::optim::AdamWParamState&>(
        *optimizer.state().at(c10::guts::to_string(p.unsafeGetTensorImpl())));
    for (const at::Tensor& t : {p, p.grad(), state.exp_avg(), state.exp_avg_sq()}) tensors.push_back(local_tensor(t));
  }
  return tensors;
}

// Bytes of this rank's shards of the model's parameters on `n` ranks, from the shapes: torch.chunk
// rows of dim 0 (ceil(rows / n) each, the last ones fewer), times the elements of a row, fp32.
int64_t shard_bytes(int n, int rank) {
  Llama whole_model(config());
  int64_t bytes = 0;
  for (const at::Tensor& p : whole_model.parameters()) {
    const int64_t rows = p.size(0), chunk = (rows + n - 1) / n;
    const int64_t mine = std::max<int64_t>(0, std::min(chunk, rows - rank * chunk));
    bytes += mine * (p.numel() / rows) * 4;
  }
  return bytes;
}

class OffloadTraining : public ::testing::TestWithParam<std::tuple<int, OffloadOptions::Tier>> {};

// 5 AdamW steps: every loss and every final parameter bitwise those without offload.
TEST_P(OffloadTraining, IsBitwiseTrainingWithoutOffload) {
  const auto [dp, tier] = GetParam();
  if (tier == OffloadOptions::Tier::kFile && file_tier_refused_here())
    GTEST_SKIP() << "the temp directory is on a copy-on-write file system";
  run(dp, [&, dp = dp, tier = tier](const comm::ProcessGroup& g) {
    const DeviceMesh mesh = init_device_mesh(g, "cpu", {dp}, {"dp"});
    std::map<std::string, std::vector<double>> losses;
    std::map<std::string, std::map<std::string, at::Tensor>> params;
    for (const bool offloaded : {false, true}) {
      const std::string run_name = offloaded ? "offload" : "none";
      const auto offload = offloaded ? offload_to(tier, "_rank" + std::to_string(g.rank())) : nullptr;
      auto model = sharded_llama(mesh, offload);
      AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < kSteps; ++step)
        losses[run_name].push_back(train_step(*model, optimizer, mesh, step, dp, g.rank()));
      for (const auto& item : model->named_parameters()) {
        params[run_name][item.key()] = whole(item.value()).detach().clone();
        if (offloaded)
          EXPECT_EQ(storage_tier_of(local_tensor(item.value())), &offload->tier())
              << item.key() << " is not in the tier";
      }
    }
    const std::string what = std::string(tier_name(tier)) + " tier on " + std::to_string(dp) + " ranks";
    for (int step = 0; step < kSteps; ++step)
      EXPECT_EQ(losses["offload"][step], losses["none"][step]) << what << ": step " << step;
    for (const auto& [name, want] : params["none"])
      check_close(params["offload"].at(name), want, what + ": " + name, true);
  });
}

INSTANTIATE_TEST_SUITE_P(RanksAndTiers, OffloadTraining,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Values(OffloadOptions::Tier::kHost,
                                                                                       OffloadOptions::Tier::kFile)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "Ranks" +
                                  (std::get<1>(info.param) == OffloadOptions::Tier::kFile ? "File" : "Host");
                         });

// After the steps, the compute allocator holds every parameter shard, gradient and AdamW moment
// without offload (4 x the shard bytes from the shapes, each one a live allocation of its timeline)
// and none of them with it: the tier holds exactly those bytes. Over the steps after the first, the
// peak is lower by at least what lives through a whole step (shards and moments, 3 x the shard
// bytes). (The tracker's totals also count the transport's buffers, freed by its threads at times
// of their own; so the test follows the tensors.)
TEST(ParameterOffload, TheComputeAllocatorHoldsNoneOfTheOffloadedBytes) {
  constexpr int kRanks = 2;
  run(kRanks, [](const comm::ProcessGroup& g) {
    const DeviceMesh mesh = init_device_mesh(g, "cpu", {kRanks}, {"dp"});
    const int64_t shards = shard_bytes(kRanks, g.rank());
    const std::string rank = "rank " + std::to_string(g.rank());
    std::map<bool, int64_t> peak;
    for (const bool offloaded : {false, true}) {
      const auto offload = offloaded ? offload_to(OffloadOptions::Tier::kHost) : nullptr;
      MemoryTracker tracker;
      auto timeline = std::make_shared<MemoryTimeline>();
      tracker.record(timeline);
      auto model = sharded_llama(mesh, offload);
      AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
      train_step(*model, optimizer, mesh, 0, kRanks, g.rank());
      tracker.reset_peak();
      for (int step = 1; step < kSteps; ++step) train_step(*model, optimizer, mesh, step, kRanks, g.rank());
      peak[offloaded] = tracker.peak();
      int64_t bytes = 0, in_compute_allocator = 0;
      for (const at::Tensor& t : offloaded_tensors(*model, optimizer)) {
        bytes += t.numel() * 4;
        if (timeline->live_allocation(t.storage().data_ptr().get_context()) >= 0) in_compute_allocator += t.numel() * 4;
        EXPECT_EQ(storage_tier_of(t), offloaded ? &offload->tier() : nullptr) << rank;
      }
      EXPECT_EQ(bytes, 4 * shards) << rank;
      EXPECT_EQ(in_compute_allocator, offloaded ? 0 : bytes) << rank << (offloaded ? ", offload" : ", none");
      if (offloaded) EXPECT_EQ(offload->stats().bytes_in_use, bytes) << rank;
    }
    std::cout << rank << ": peak without offload " << peak[false] << " bytes, with " << peak[true] << "; shard bytes "
              << shards << "\n";
    EXPECT_GE(peak[false] - peak[true], 3 * shards) << rank;
  });
}

// Pages of `t`'s storage in memory (its mapping of the file tier: the page cache's pages of it).
int64_t resident_pages(const at::Tensor& t) {
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t bytes = static_cast<int64_t>(t.storage().nbytes());
  std::vector<unsigned char> resident((bytes + page - 1) / page);
  EXPECT_EQ(mincore(t.storage().data_ptr().get(), bytes, resident.data()), 0);
  return std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) != 0; });
}

// Between uses the file tier holds none of its tensors' pages in memory: not after the optimizer
// step (parameters, gradients, moments), not after a forward (the shards the gathers read).
TEST(ParameterOffload, TheFileTierHoldsNothingInMemoryBetweenUses) {
  if (file_tier_refused_here()) GTEST_SKIP() << "the temp directory is on a copy-on-write file system";
  const auto offload = offload_to(OffloadOptions::Tier::kFile);
  if (detail::on_memory_file_system(offload->options().directory))
    GTEST_SKIP() << offload->options().directory << " is a tmpfs or ramfs: its files are memory";
  run(2, [&](const comm::ProcessGroup& g) {
    const DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"dp"});
    auto model = sharded_llama(mesh, offload);
    AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int step = 0; step < 2; ++step) train_step(*model, optimizer, mesh, step, 2, g.rank());
    int64_t pages = 0;
    for (const at::Tensor& t : offloaded_tensors(*model, optimizer)) pages += resident_pages(t);
    EXPECT_EQ(pages, 0) << "after the optimizer step, rank " << g.rank();
    optimizer.zero_grad();
    auto [tokens, targets] = batch(2, g.rank() * 2, 2);
    at::Tensor loss = cross_entropy((*model)(tokens), targets);
    pages = 0;
    for (const at::Tensor& p : model->parameters()) pages += resident_pages(local_tensor(p));
    EXPECT_EQ(pages, 0) << "after forward, rank " << g.rank();
    loss.backward();
  });
}

// A tensor moved into a tier is the same tensor (views of its storage too) with the same values;
// its zeros_like is in the tier; the tier's buffers are free again once the tensors are gone.
TEST(StorageTier, AMovedTensorKeepsItsIdentityAndValues) {
  for (const OffloadOptions::Tier tier : {OffloadOptions::Tier::kHost, OffloadOptions::Tier::kFile}) {
    if (tier == OffloadOptions::Tier::kFile && file_tier_refused_here()) continue;
    const auto offload = offload_to(tier);
    const std::string what = tier_name(tier);
    {
      const at::Tensor before = at::randn({3, 1000});
      MemoryTracker tracker;
      at::Tensor t = before.clone();
      const at::Tensor view = t[1];
      const auto version = t._version();
      EXPECT_EQ(tracker.current(), t.numel() * 4) << what;
      move_storage_to(t, offload->tier());
      EXPECT_EQ(tracker.current(), 0) << what << ": the compute allocator's bytes are given back";
      EXPECT_EQ(storage_tier_of(t), &offload->tier()) << what;
      EXPECT_EQ(storage_tier_of(view), &offload->tier()) << what;
      EXPECT_EQ(t._version(), version) << what;
      check_close(t, before, what, /*bitwise=*/true);
      view.fill_(2);
      EXPECT_EQ(t[1][999].item<float>(), 2) << what;
      const at::Tensor zeros = zeros_like_in_its_tier(t);
      EXPECT_EQ(storage_tier_of(zeros), &offload->tier()) << what;
      EXPECT_EQ(zeros.abs().sum().item<float>(), 0) << what;
      EXPECT_EQ(offload->stats().bytes_in_use, 2 * t.numel() * 4) << what;
      settle_storage({t, zeros});
      check_close(t[0], before[0], what + ", settled", /*bitwise=*/true);
      EXPECT_EQ(storage_tier_of(at::zeros_like(t)), nullptr) << what << ": ATen's own zeros_like";
    }
    EXPECT_EQ(offload->stats().bytes_in_use, 0) << what;
    EXPECT_GT(offload->stats().bytes_held, 0) << what;
  }
}

// A meta tensor (a dry run) moves into a tier without bytes: it is counted out of the meta
// allocator, keeps its tier alive, and what is made like it lands in the tier too.
TEST(StorageTier, AMetaTensorIsInItsTierWithoutBytes) {
  auto offload = offload_to(OffloadOptions::Tier::kHost);
  StorageTier* tier = &offload->tier();
  MemoryTracker tracker(MemoryTracker::kMeta);
  const at::Tensor t = at::empty({64, 16}, at::TensorOptions().device(at::kMeta));
  EXPECT_EQ(tracker.current(), 64 * 16 * 4);
  move_storage_to(t, *tier);
  EXPECT_EQ(tracker.current(), 0);
  offload.reset();  // the tensor keeps the tier
  EXPECT_EQ(storage_tier_of(t), tier);
  const at::Tensor zeros = zeros_like_in_its_tier(t);
  EXPECT_TRUE(zeros.is_meta());
  EXPECT_EQ(storage_tier_of(zeros), tier);
  EXPECT_EQ(tracker.current(), 0);
}

// What offload does not cover is refused by name: ZeRO-1/2 units (their gathered parameters stay
// in the compute allocator), and LibTorch's AdamW step on an offloaded parameter.
TEST(ParameterOffload, WhatItDoesNotCoverIsRefused) {
  run(2, [](const comm::ProcessGroup& g) {
    const DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"dp"});
    Llama model(config());
    FullyShardOptions options;
    options.offload = offload_to(OffloadOptions::Tier::kHost);
    options.level = ShardingLevel::kGradients;
    expect_error([&] { fully_shard(model, mesh, options); }, "parameter offload needs ZeRO-3");
    auto sharded = sharded_llama(mesh, offload_to(OffloadOptions::Tier::kHost));
    AdamW optimizer(sharded->parameters(), torch::optim::AdamWOptions(1e-2), /*foreach=*/false);
    expect_error([&] { optimizer.step(); }, "foreach=false does not");
  });
}

// Tensors hold their tier: one that no shared_ptr owns is refused by name, before it allocates.
TEST(StorageTier, ATierMustBeSharedOwned) {
  struct Counting : StorageTier {
    int allocations = 0;
    std::unique_ptr<Allocation> allocate(int64_t) override {
      ++allocations;
      return nullptr;
    }
  } on_the_stack;
  expect_error([&] { move_storage_to(at::ones({4}), on_the_stack); }, "must be owned by a std::shared_ptr");
  EXPECT_EQ(on_the_stack.allocations, 0);
}

TEST(ParameterOffload, ATierThatCannotBeMadeSaysWhy) {
  OffloadOptions nowhere{OffloadOptions::Tier::kFile, "/proc/hp-no-such-directory"};
  expect_error([&] { ParameterOffload offload(nowhere); },
               "parameter offload: cannot create the file tier's file in '/proc/hp-no-such-directory'");
}

}  // namespace
}  // namespace hp::test
