#include "dcp/metadata.h"

#include <filesystem>
#include <optional>

#include "dcp/file_io.h"
#include "dcp/safetensors.h"
#include "dcp/xxhash64.h"
#include "hp/core/checked_size.h"
#include "hp/core/error.h"

namespace hp::dcp::detail {
namespace {

// Elements of a box whose sizes come from the file: an overflow is a damaged file, not a wrap.
int64_t volume(const std::vector<int64_t>& sizes, const std::string& what) {
  const std::optional<int64_t> n = checked_product(sizes);
  HP_CHECK(n, what, " has sizes ", c10::IntArrayRef(sizes), " that are negative or overflow 64 bits");
  return *n;
}

bool boxes_overlap(const ChunkRecord& a, const ChunkRecord& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d)
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] || b.offsets[d] >= a.offsets[d] + a.sizes[d]) return false;
  return true;
}

void check_tensor(const std::string& name, const TensorRecord& t, uint64_t block_bytes) {
  const size_t element = dtype_bytes(t.dtype);
  const int64_t elements = volume(t.shape, "tensor '" + name + "'");
  HP_CHECK(checked_product({elements}, static_cast<int64_t>(element)), "tensor '", name, "' of shape ",
           c10::IntArrayRef(t.shape), " needs more than 2^63 bytes");
  int64_t covered = 0;
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const ChunkRecord& c = t.chunks[i];
    HP_CHECK(c.offsets.size() == t.shape.size() && c.sizes.size() == t.shape.size(), "tensor '", name,
             "': a chunk has ", c.offsets.size(), " offsets and ", c.sizes.size(), " sizes for a ", t.shape.size(),
             "-d tensor");
    for (size_t d = 0; d < t.shape.size(); ++d)
      HP_CHECK(c.offsets[d] >= 0 && c.sizes[d] > 0 && c.offsets[d] <= t.shape[d] - c.sizes[d], "tensor '", name,
               "': chunk ", i, " lies outside the tensor in dim ", d);
    // Inside a shape whose volume fits in int64 (checked first), a box's byte size fits in uint64.
    const uint64_t box_bytes = static_cast<uint64_t>(volume(c.sizes, "a chunk")) * element;
    HP_CHECK(c.nbytes == box_bytes, "tensor '", name, "': chunk ", i, " has ", c.nbytes, " bytes, its box needs ",
             box_bytes);
    HP_CHECK(c.checksums.size() == (c.nbytes + block_bytes - 1) / block_bytes, "tensor '", name, "': chunk ", i,
             " has ", c.checksums.size(), " checksums for ", c.nbytes, " bytes");
    HP_CHECK(!c.file.empty() && c.file.find('/') == std::string::npos && c.file.find("..") == std::string::npos,
             "tensor '", name, "': chunk ", i, " names file '", c.file, "'");
    for (size_t j = 0; j < i; ++j)
      HP_CHECK(!boxes_overlap(c, t.chunks[j]), "tensor '", name, "': chunks ", j, " and ", i, " overlap");
    covered += volume(c.sizes, "a chunk");  // disjoint boxes inside the shape: no overflow
  }
  HP_CHECK(covered == elements, "tensor '", name, "': its chunks cover ", covered, " of ", elements, " elements");
}

}  // namespace

nlohmann::json chunk_to_json(const ChunkRecord& c) {
  std::vector<std::string> sums;
  for (uint64_t s : c.checksums) sums.push_back(hex64(s));
  return {{"offsets", c.offsets},         {"sizes", c.sizes},   {"file", c.file},
          {"byte_offset", c.byte_offset}, {"nbytes", c.nbytes}, {"checksums", sums}};
}

ChunkRecord chunk_from_json(const nlohmann::json& j) {
  ChunkRecord c;
  c.offsets = j.at("offsets").get<std::vector<int64_t>>();
  c.sizes = j.at("sizes").get<std::vector<int64_t>>();
  c.file = j.at("file").get<std::string>();
  c.byte_offset = j.at("byte_offset").get<uint64_t>();
  c.nbytes = j.at("nbytes").get<uint64_t>();
  for (const auto& s : j.at("checksums")) {
    const std::string hex = s.get<std::string>();
    HP_CHECK(hex.size() == 16 && hex.find_first_not_of("0123456789abcdef") == std::string::npos, "bad checksum '", hex,
             "'");
    c.checksums.push_back(std::stoull(hex, nullptr, 16));
  }
  return c;
}

nlohmann::json to_json(const Metadata& m) {
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& [name, t] : m.tensors) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& c : t.chunks) chunks.push_back(chunk_to_json(c));
    tensors[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"chunks", chunks}};
  }
  return {{"format", kFormat},
          {"version", kVersion},
          {"world_size", m.world_size},
          {"checksum", "xxh64"},
          {"checksum_block_bytes", m.checksum_block_bytes},
          {"values", m.values},
          {"tensors", tensors}};
}

Metadata metadata_from_json(const nlohmann::json& j, const std::string& where) {
  Metadata m;
  std::string current = "(header)";
  try {
    HP_CHECK(j.is_object() && j.value("format", "") == kFormat, "not an hp-dcp metadata file");
    HP_CHECK(j.at("version").get<int>() == kVersion, "format version ", j.at("version"), ", this build reads ",
             kVersion);
    HP_CHECK(j.at("checksum").get<std::string>() == "xxh64", "unknown checksum ", j.at("checksum"));
    m.world_size = j.at("world_size").get<int>();
    m.checksum_block_bytes = j.at("checksum_block_bytes").get<uint64_t>();
    HP_CHECK(m.checksum_block_bytes >= 8 && m.checksum_block_bytes % 8 == 0, "checksum_block_bytes ",
             m.checksum_block_bytes, " is not a positive multiple of 8");
    m.values = j.at("values");
    for (const auto& [name, t] : j.at("tensors").items()) {
      current = "tensor '" + name + "'";
      TensorRecord record;
      record.dtype = t.at("dtype").get<std::string>();
      scalar_type_of(record.dtype);  // checks the name
      record.shape = t.at("shape").get<std::vector<int64_t>>();
      for (const auto& c : t.at("chunks")) record.chunks.push_back(chunk_from_json(c));
      check_tensor(name, record, m.checksum_block_bytes);
      m.tensors.emplace(name, std::move(record));
    }
  } catch (const nlohmann::json::exception& e) {
    HP_FAIL("dcp: ", where, " is damaged (", current, "): ", e.what());
  } catch (const Error& e) {
    HP_FAIL("dcp: ", where, " is damaged: ", e.what());
  }
  return m;
}

Metadata read_metadata(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kMetadataFile).string();
  HP_CHECK(std::filesystem::is_directory(dir), "dcp: no checkpoint directory ", dir);
  HP_CHECK(std::filesystem::exists(path), "dcp: ", dir, " has no ", kMetadataFile,
           " (not a checkpoint, or its save never committed)");
  const std::string text = read_file(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    HP_FAIL("dcp: ", path, " is damaged (truncated or not JSON): ", e.what());
  }
  return metadata_from_json(j, path);
}

}  // namespace hp::dcp::detail
