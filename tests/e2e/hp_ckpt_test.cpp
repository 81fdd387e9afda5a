// hp-ckpt on files from strangers: a clear one-line error and exit 1, never a crash.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "e2e/e2e_util.h"
#include "scratch_dir.h"

namespace {
namespace fs = std::filesystem;

// Converting an HF directory whose header declares a [2^62, 4] F32 tensor in 0 bytes (the size
// wraps in 64 bits) died with an uncaught c10::Error (exit 134).
TEST(HpCkpt, HostileHfHeaderIsAClearError) {
  const std::string dir = hp::test::scratch_dir("hp_ckpt_hostile");
  const std::string header = R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})";
  std::ofstream out(fs::path(dir) / "model.safetensors", std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header.size() >> (8 * i)) & 0xff));
  out << header;
  out.close();
  const hp::e2e::Result r =
      hp::e2e::run_command(hp::e2e::bin_dir() + "/hp-ckpt convert --from hf " + dir + " " + dir + "/out");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("hp-ckpt: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("overflows 64 bits"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/out"));
}

}  // namespace
