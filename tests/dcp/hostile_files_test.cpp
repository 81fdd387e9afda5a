// Files from strangers: hand-made safetensors headers and checkpoint metadata that lie about sizes
// are refused with an hp::Error naming the file and the problem, before anything is allocated; and
// a bounded, seeded mutation fuzzer over valid files finds no crash and no other exception.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>

#include "hp/dcp/checkpoint.h"
#include "hp/dcp/hf.h"
#include "scratch_dir.h"
#include "test_util.h"

namespace hp {
namespace {
namespace fs = std::filesystem;

// A safetensors file with this JSON header (8-byte little-endian length first) and `data_bytes`
// zero bytes of data.
void write_safetensors(const fs::path& path, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << std::string(data_bytes, '\0');
}

// The HF directory `name` holding one model.safetensors with `header`.
std::string hf_dir(const std::string& name, const std::string& header, size_t data_bytes = 0) {
  const std::string dir = test::scratch_dir("hostile_" + name);
  write_safetensors(fs::path(dir) / "model.safetensors", header, data_bytes);
  return dir;
}

// A shape whose byte size wraps to 0 in 64 bits ([2^62, 4] F32 = 2^66 bytes) passed the size check
// before, and the load then died allocating it.
TEST(HostileSafetensors, OverflowingShapeIsRefused) {
  const std::string dir =
      hf_dir("overflow", R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})");
  test::expect_error([&] { dcp::load_hf_whole(dir); }, {"model.safetensors", "tensor 'w'", "overflows 64 bits"});
}

// Every lie about sizes or places names the file and what is wrong.
TEST(HostileSafetensors, LiesAboutSizesAreRefused) {
  const struct {
    const char* name;
    std::string header;
    size_t data_bytes;
    const char* says;
  } cases[] = {
      {"negative", R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,0]}})", 0, "negative size"},
      {"short", R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}})", 8, "need 16"},
      {"past_end", R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 8, "truncated"},
      {"backwards", R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8, "ends before it begins"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       16, "overlap"},
      {"dtype", R"({"w":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", 16, "unknown dtype 'F128'"},
      {"not_json", "{\"w\":", 0, "not valid"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = hf_dir(c.name, c.header, c.data_bytes);
    test::expect_error([&] { dcp::load_hf_whole(dir); }, {"model.safetensors", c.says});
  }
  const std::string huge = test::scratch_dir("hostile_huge_header");
  write_safetensors(fs::path(huge) / "model.safetensors", "", 0);
  std::fstream(fs::path(huge) / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary)
      .write("\xff\xff\xff\xff\xff\xff\xff\x7f", 8);  // declares a 2^63-byte header
  test::expect_error([&] { dcp::load_hf_whole(huge); }, {"model.safetensors", "declares a header"});
}

// A Hugging Face index may only name files in its own directory.
TEST(HostileSafetensors, IndexNamingAPathOutsideIsRefused) {
  for (const char* file : {"../model.safetensors", "/etc/passwd", "sub/model.safetensors", ""}) {
    SCOPED_TRACE(file);
    const std::string dir = hf_dir("index", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4);
    std::ofstream(fs::path(dir) / "model.safetensors.index.json")
        << nlohmann::json{{"weight_map", {{"w", file}}}}.dump();
    test::expect_error([&] { dcp::load_hf_whole(dir); },
                       {"model.safetensors.index.json", "which is not a file name in that directory"});
  }
}

// Checkpoint metadata whose shape or chunk boxes overflow is a damaged checkpoint, not a wrap.
TEST(HostileMetadata, OverflowingShapesAreRefused) {
  const auto metadata = [](const nlohmann::json& shape, const nlohmann::json& sizes) {
    return nlohmann::json{{"format", "hp-dcp"},
                          {"version", 1},
                          {"world_size", 1},
                          {"checksum", "xxh64"},
                          {"checksum_block_bytes", 8},
                          {"values", nlohmann::json::object()},
                          {"tensors",
                           {{"w",
                             {{"dtype", "F32"},
                              {"shape", shape},
                              {"chunks",
                               {{{"offsets", {0, 0}},
                                 {"sizes", sizes},
                                 {"file", "rank-00000.safetensors"},
                                 {"byte_offset", 0},
                                 {"nbytes", 0},
                                 {"checksums", nlohmann::json::array()}}}}}}}}};
  };
  const int64_t big = int64_t{1} << 62;
  const struct {
    const char* name;
    nlohmann::json shape, sizes;
    const char* says;
  } cases[] = {
      {"shape", {big, 4}, {big, 4}, "overflow 64 bits"},
      {"bytes", {big, 1}, {big, 1}, "needs more than 2^63 bytes"},
      {"outside", {4, 4}, {2, std::numeric_limits<int64_t>::max()}, "lies outside the tensor"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = test::scratch_dir(std::string("hostile_metadata_") + c.name);
    std::ofstream(fs::path(dir) / "metadata.json") << metadata(c.shape, c.sizes).dump();
    test::expect_error([&] { dcp::verify(dir); }, {"metadata.json", "tensor 'w'", c.says});
  }
}

// Bytes of `original` with `count` of them replaced at random positions (seeded, so every run
// tries the same files), sometimes cut short or extended.
std::string mutate(const std::string& original, std::mt19937_64& random, size_t count) {
  std::string out = original;
  for (size_t k = 0; k < count; ++k) out[random() % out.size()] = static_cast<char>(random() & 0xff);
  switch (random() % 8) {
    case 0:
      out.resize(random() % out.size());
      break;  // truncated
    case 1:
      out += std::string(random() % 64, static_cast<char>(random()));
      break;  // trailing bytes
    default:
      break;
  }
  return out;
}

// Reads `read` over `iterations` mutations of a valid file (its bytes in `valid`, written to
// `path`): every outcome is success or an hp::Error naming the file, never a crash or another
// exception; the error names the file's directory. Under scripts/sanitize the same runs check memory
// safety.
void fuzz(const std::string& path, const std::string& valid, int iterations, const std::function<void()>& read) {
  std::mt19937_64 random(20261201);
  int refused = 0;
  for (int i = 0; i < iterations; ++i) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << mutate(valid, random, 1 + random() % 4);
    try {
      read();
    } catch (const Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find(fs::path(path).parent_path().filename().string()), std::string::npos)
          << "iteration " << i << ": the error does not name the directory: " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << i << ": not an hp::Error: " << e.what();
    }
  }
  EXPECT_GT(refused, iterations / 4) << "the mutations should mostly damage the file";
}

// A bounded mutation fuzzer over a valid safetensors file (header and data).
TEST(HostileSafetensors, MutatedFilesAreReadOrRefusedCleanly) {
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("b":{"dtype":"I64","shape":[4],"data_offsets":[24,56]}})";
  const std::string dir = hf_dir("fuzz", header, 56);
  const std::string path = dir + "/model.safetensors";
  std::ifstream in(path, std::ios::binary);
  const std::string valid((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(dcp::load_hf_whole(dir).tensors.size(), 2u);
  fuzz(path, valid, 400, [&] { dcp::load_hf_whole(dir); });
}

// The same over a real checkpoint's metadata.json, read by verify (which also reads every chunk).
TEST(HostileMetadata, MutatedMetadataIsReadOrRefusedCleanly) {
  const std::string dir = test::scratch_dir("hostile_metadata_fuzz");
  test::run(1, [&](const comm::ProcessGroup& group) {
    dcp::StateDict state;
    state.tensors["w"] = at::arange(12, at::kFloat).view({3, 4});
    state.tensors["b"] = at::arange(5, at::kLong);
    state.values["step"] = 7;
    dcp::save(state, dir, group);
  });
  const std::string path = dir + "/metadata.json";
  std::ifstream in(path, std::ios::binary);
  const std::string valid((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(dcp::verify(dir).tensors, 2);
  fuzz(path, valid, 400, [&] { dcp::verify(dir); });
}

}  // namespace
}  // namespace hp
