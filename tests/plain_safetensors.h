// A safetensors reader written from the format description alone (8-byte little-endian header
// length, JSON header, raw little-endian bytes), so tests of our writers do not trust the
// library's own parser. F32 tensors only.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace hp::test {

inline std::map<std::string, at::Tensor> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  std::map<std::string, at::Tensor> out;
  const nlohmann::json parsed = nlohmann::json::parse(header);
  for (const auto& [name, info] : parsed.items()) {
    if (name == "__metadata__") continue;
    EXPECT_EQ(info.at("dtype"), "F32") << name;
    const auto offsets = info.at("data_offsets").get<std::vector<int64_t>>();
    at::Tensor t = at::empty(info.at("shape").get<std::vector<int64_t>>(), at::kFloat);
    EXPECT_EQ(offsets[1] - offsets[0], t.numel() * 4) << name;
    in.seekg(static_cast<std::streamoff>(8 + n + offsets[0]));
    in.read(static_cast<char*>(t.data_ptr()), offsets[1] - offsets[0]);
    out[name] = t;
  }
  return out;
}

}  // namespace hp::test
