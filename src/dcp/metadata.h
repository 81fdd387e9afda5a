// metadata.json of a checkpoint: the index load() reads first. Parsing checks it completely, so a
// truncated or hand-edited file fails here with the file named instead of later with a bad read.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace hp::dcp::detail {

inline constexpr const char* kFormat = "hp-dcp";
inline constexpr int kVersion = 1;
inline constexpr const char* kMetadataFile = "metadata.json";

struct ChunkRecord {
  std::vector<int64_t> offsets, sizes;  // the chunk's box in the global tensor
  std::string file;                     // relative to the checkpoint directory
  uint64_t byte_offset = 0;             // where its bytes start in the file
  uint64_t nbytes = 0;
  std::vector<uint64_t> checksums;  // XXH64 of each checksum block
};

struct TensorRecord {
  std::string dtype;  // safetensors name
  std::vector<int64_t> shape;
  std::vector<ChunkRecord> chunks;
};

struct Metadata {
  int world_size = 0;
  uint64_t checksum_block_bytes = 0;
  std::map<std::string, TensorRecord> tensors;
  nlohmann::json values = nlohmann::json::object();
};

nlohmann::json chunk_to_json(const ChunkRecord& chunk);
ChunkRecord chunk_from_json(const nlohmann::json& j);
nlohmann::json to_json(const Metadata& metadata);
// Parses and checks (`where` names the file in errors): every chunk inside its tensor, chunks of a
// tensor disjoint and covering it exactly, checksum counts matching the byte counts.
Metadata metadata_from_json(const nlohmann::json& j, const std::string& where);
Metadata read_metadata(const std::string& dir);

}  // namespace hp::dcp::detail
