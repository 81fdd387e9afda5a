// The safetensors container (Hugging Face): an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}} padded with
// spaces to a multiple of 8, then the raw little-endian bytes of every tensor back to back.
// Checkpoint shards and HF exports are both written in it, so any safetensors reader opens them.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace hp::dcp::detail {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
};

struct SafetensorsFile {
  uint64_t data_start = 0;                // file offset of the data section
  std::vector<SafetensorsEntry> entries;  // in data order
  std::map<std::string, std::string> metadata;
};

std::string safetensors_dtype(c10::ScalarType type);       // throws for types safetensors lacks
c10::ScalarType scalar_type_of(const std::string& dtype);  // throws for unknown names
size_t dtype_bytes(const std::string& dtype);

// The header bytes (length prefix included) for `entries` laid out in the given order; fills each
// entry's begin/end.
std::string safetensors_header(std::vector<SafetensorsEntry>& entries,
                               const std::map<std::string, std::string>& metadata);

// Parses and checks the header of `path` (sizes, dtypes, offsets inside the file, no overlaps);
// errors name the file.
SafetensorsFile read_safetensors_header(const std::string& path);

}  // namespace hp::dcp::detail
