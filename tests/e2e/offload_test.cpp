// memory.offload as a user runs it, one hp-train process: with the file tier the parameters,
// gradients and AdamW moments wait in a file between uses, so the process's resident memory holds
// less than with the host tier, by about all of them; the losses are bitwise those of the host
// tier and of no offload.
#include <gtest/gtest.h>
#include <sys/vfs.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "e2e/e2e_util.h"
#include "scratch_dir.h"

namespace {
using hp::e2e::Measured;
using hp::e2e::train_losses;

constexpr int64_t kVocab = 256, kLayers = 16, kDim = 384, kKvDim = 192, kFfn = 1024;  // 8 heads, 4 for k and v

// The model's parameters, from its shapes: embedding and output head, the final norm, and per block
// two norms, q and o (dim x dim), k and v (kv_dim x dim) and the three MLP matrices.
constexpr int64_t kParameters =
    2 * kVocab * kDim + kDim + kLayers * (2 * kDim + 2 * kDim * kDim + 2 * kKvDim * kDim + 3 * kFfn * kDim);
// What the tier holds: each parameter, its gradient and its two AdamW moments, fp32.
constexpr int64_t kOffloadedBytes = 16 * kParameters;

Measured train(const std::string& dir, const std::string& offload) {
  const std::vector<std::string> argv =
      hp::e2e::one_rank_training(dir, offload, kLayers, kDim, kFfn, 4, {"memory.offload=" + offload});
  return hp::e2e::run_measuring_memory(argv, dir + "/" + offload + ".log");
}

// Whether `path` is on a file system that keeps its files in memory (tmpfs, ramfs).
bool in_memory(const std::string& path) {
  struct statfs fs {};
  return statfs(path.c_str(), &fs) == 0 &&
         (static_cast<uint32_t>(fs.f_type) == 0x01021994u || static_cast<uint32_t>(fs.f_type) == 0x858458f6u);
}

TEST(HpTrain, FileOffloadKeepsParametersOutOfResidentMemory) {
  const std::string dir = hp::test::scratch_dir("train_e2e_offload");
  if (in_memory(dir)) GTEST_SKIP() << dir << " is a tmpfs or ramfs: a file tier there is memory";
  std::map<std::string, Measured> runs;
  for (const std::string offload : {"none", "host", "file"}) {
    runs[offload] = train(dir, offload);
    ASSERT_EQ(runs[offload].exit_code, 0) << offload << "\n" << runs[offload].output;
  }
  const auto losses = train_losses(dir + "/none");
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_EQ(train_losses(dir + "/host"), losses);
  EXPECT_EQ(train_losses(dir + "/file"), losses);
  const long host_kb = runs["host"].max_rss_kb, file_kb = runs["file"].max_rss_kb;
  std::cout << "peak resident memory: none " << runs["none"].max_rss_kb / 1024 << " MiB, host " << host_kb / 1024
            << " MiB, file " << file_kb / 1024 << " MiB; the tier holds " << (kOffloadedBytes >> 20) << " MiB\n";
  // A file tier that kept its pages, or an optimizer step that brought the whole state in at once,
  // would save little of it.
  EXPECT_GE(host_kb - file_kb, kOffloadedBytes / 1024 * 3 / 4)
      << "the file tier should keep at least 3/4 of what it holds out of resident memory";
}

}  // namespace
