#include "dcp/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <optional>
#include <utility>

#include "hp/core/checked_size.h"
#include "hp/core/error.h"

namespace hp::dcp::detail {
namespace {

const std::vector<std::pair<c10::ScalarType, std::string>>& dtype_table() {
  static const std::vector<std::pair<c10::ScalarType, std::string>> table = {
      {c10::kFloat, "F32"}, {c10::kDouble, "F64"}, {c10::kHalf, "F16"}, {c10::kBFloat16, "BF16"}, {c10::kLong, "I64"},
      {c10::kInt, "I32"},   {c10::kShort, "I16"},  {c10::kChar, "I8"},  {c10::kByte, "U8"},       {c10::kBool, "BOOL"}};
  return table;
}

}  // namespace

std::string safetensors_dtype(c10::ScalarType type) {
  for (const auto& [t, name] : dtype_table())
    if (t == type) return name;
  HP_FAIL("safetensors: dtype ", c10::toString(type), " has no safetensors name");
}

c10::ScalarType scalar_type_of(const std::string& dtype) {
  for (const auto& [t, name] : dtype_table())
    if (name == dtype) return t;
  HP_FAIL("safetensors: unknown dtype '", dtype, "'");
}

size_t dtype_bytes(const std::string& dtype) { return c10::elementSize(scalar_type_of(dtype)); }

std::string safetensors_header(std::vector<SafetensorsEntry>& entries,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (auto& e : entries) {
    uint64_t bytes = dtype_bytes(e.dtype);
    for (int64_t s : e.shape) bytes *= static_cast<uint64_t>(s);
    e.begin = offset;
    e.end = offset + bytes;
    offset = e.end;
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

SafetensorsFile read_safetensors_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  HP_CHECK(in, "safetensors: cannot open ", path);
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  unsigned char len_bytes[8];
  HP_CHECK(file_size >= 8 && in.read(reinterpret_cast<char*>(len_bytes), 8), "safetensors: ", path,
           " is too short to hold a header (", file_size, " bytes)");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  HP_CHECK(header_len <= file_size - 8 && header_len < (uint64_t{100} << 20), "safetensors: ", path,
           " declares a header of ", header_len, " bytes but the file has ", file_size);
  std::string text(header_len, '\0');
  HP_CHECK(in.read(text.data(), static_cast<std::streamsize>(header_len)), "safetensors: cannot read the header of ",
           path);

  SafetensorsFile file;
  file.data_start = 8 + header_len;
  const uint64_t data_size = file_size - file.data_start;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
    HP_CHECK(header.is_object(), "the header is not a JSON object");
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        file.metadata = it.value().get<std::map<std::string, std::string>>();
        continue;
      }
      SafetensorsEntry e;
      e.name = it.key();
      e.dtype = it.value().at("dtype").get<std::string>();
      e.shape = it.value().at("shape").get<std::vector<int64_t>>();
      const auto offsets = it.value().at("data_offsets").get<std::vector<uint64_t>>();
      HP_CHECK(offsets.size() == 2, "tensor '", e.name, "' has ", offsets.size(), " data_offsets");
      e.begin = offsets[0];
      e.end = offsets[1];
      for (int64_t s : e.shape) HP_CHECK(s >= 0, "tensor '", e.name, "' has a negative size");
      const std::optional<int64_t> needed = checked_product(e.shape, static_cast<int64_t>(dtype_bytes(e.dtype)));
      HP_CHECK(needed, "tensor '", e.name, "' has shape ", c10::IntArrayRef(e.shape),
               " whose size in bytes overflows 64 bits");
      const uint64_t bytes = static_cast<uint64_t>(*needed);
      HP_CHECK(e.begin <= e.end, "tensor '", e.name, "' ends before it begins (data_offsets ", e.begin, ", ", e.end,
               ")");
      HP_CHECK(e.end - e.begin == bytes, "tensor '", e.name, "' spans ", e.end - e.begin,
               " bytes but its shape and dtype need ", bytes);
      HP_CHECK(e.end <= data_size, "tensor '", e.name, "' ends at byte ", e.end, " of a ", data_size,
               "-byte data section (the file is truncated)");
      file.entries.push_back(std::move(e));
    }
  } catch (const nlohmann::json::exception& e) {
    HP_FAIL("safetensors: the header of ", path, " is not valid: ", e.what());
  } catch (const Error& e) {
    HP_FAIL("safetensors: ", path, ": ", e.what());
  }
  std::sort(file.entries.begin(), file.entries.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < file.entries.size(); ++i)
    HP_CHECK(file.entries[i].begin >= file.entries[i - 1].end, "safetensors: ", path, ": tensors '",
             file.entries[i - 1].name, "' and '", file.entries[i].name, "' overlap");
  return file;
}

}  // namespace hp::dcp::detail
