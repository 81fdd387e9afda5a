// memory.swap as a user runs it, one hp-train process: with the file tier the blocks' activations
// wait in a file, so the process's resident memory holds less than with the host tier, and the
// losses are bitwise those of the host tier and of no swap.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "e2e/e2e_util.h"
#include "scratch_dir.h"

namespace {
using hp::e2e::Measured;
using hp::e2e::train_losses;

constexpr int64_t kLayers = 8, kDim = 128, kKvDim = 64, kFfn = 384;  // 8 heads, 4 of them for k and v
constexpr int64_t kTokens = 32 * 128;                                // a micro-batch of 32 sequences of 128

// What the host tier holds at the end of forward: the matrix products' outputs (q, k, v, the output
// projection, gate, up, down: default_swap_policy) of every block but the last, which stays for the
// backward that starts with it, in fp32.
constexpr int64_t kPoolBytes = (kLayers - 1) * kTokens * (2 * kDim + 2 * kKvDim + 2 * kFfn + kDim) * 4;

Measured train(const std::string& dir, const std::string& swap) {
  const std::vector<std::string> argv =
      hp::e2e::one_rank_training(dir, swap, kLayers, kDim, kFfn, 32, {"memory.swap=" + swap});
  return hp::e2e::run_measuring_memory(argv, dir + "/" + swap + ".log");
}

TEST(HpTrain, FileSwapKeepsActivationsOutOfResidentMemory) {
  const std::string dir = hp::test::scratch_dir("train_e2e_swap");
  std::map<std::string, Measured> runs;
  for (const std::string swap : {"none", "host", "file"}) {
    runs[swap] = train(dir, swap);
    ASSERT_EQ(runs[swap].exit_code, 0) << swap << "\n" << runs[swap].output;
  }
  const auto losses = train_losses(dir + "/none");
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_EQ(train_losses(dir + "/host"), losses);
  EXPECT_EQ(train_losses(dir + "/file"), losses);
  const long host_kb = runs["host"].max_rss_kb, file_kb = runs["file"].max_rss_kb;
  std::cout << "peak resident memory: none " << runs["none"].max_rss_kb / 1024 << " MiB, host " << host_kb / 1024
            << " MiB, file " << file_kb / 1024 << " MiB; the host pool holds " << (kPoolBytes >> 20) << " MiB\n";
  // About all of it (1.1x here); a tier that held its buffers in memory would save about nothing.
  EXPECT_GE(host_kb - file_kb, kPoolBytes / 1024 * 3 / 4)
      << "the file tier should keep at least 3/4 of what the host pool holds out of resident memory";
}

}  // namespace
