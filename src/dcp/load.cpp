// Loading a checkpoint: read metadata.json, then fill each tensor of the target state dict from the
// chunks that overlap its piece (src/dcp/reader.cpp). Nothing here communicates, so any world size
// and any layout can load any checkpoint.
#include <ATen/ATen.h>

#include <filesystem>

#include "dcp/metadata.h"
#include "dcp/reader.h"
#include "dcp/safetensors.h"
#include "hp/core/error.h"
#include "hp/dcp/checkpoint.h"

namespace hp::dcp {
namespace fs = std::filesystem;

void load(StateDict& state, const std::string& dir) {
  const detail::Metadata m = detail::read_metadata(dir);
  detail::Files files(dir);
  for (auto& [name, tensor] : state.tensors) {
    HP_CHECK(tensor.defined(), "dcp.load: tensor '", name, "' is undefined");
    const auto it = m.tensors.find(name);
    HP_CHECK(it != m.tensors.end(), "dcp.load: the checkpoint in ", dir, " has no tensor '", name, "'");
    detail::read_tensor(files, it->second, m.checksum_block_bytes, name, tensor, "the checkpoint in " + dir);
  }
  state.values = m.values;
}

StateDict load_whole(const std::string& dir) {
  const detail::Metadata m = detail::read_metadata(dir);
  StateDict state;
  for (const auto& [name, record] : m.tensors)
    state.tensors[name] = at::zeros(record.shape, at::TensorOptions().dtype(detail::scalar_type_of(record.dtype)));
  load(state, dir);
  return state;
}

VerifyReport verify(const std::string& dir) {
  const detail::Metadata m = detail::read_metadata(dir);
  detail::Files files(dir);
  VerifyReport report;
  std::map<std::string, bool> headers_checked;
  for (const auto& [name, record] : m.tensors) {
    ++report.tensors;
    for (const auto& chunk : record.chunks) {
      if (!headers_checked[chunk.file]) {
        detail::read_safetensors_header((fs::path(dir) / chunk.file).string());
        headers_checked[chunk.file] = true;
      }
      const uint64_t piece = uint64_t{64} << 20;  // bounded memory for large chunks
      for (uint64_t at = 0; at < chunk.nbytes; at += piece)
        detail::read_verified(files, chunk, m.checksum_block_bytes, at, std::min(chunk.nbytes, at + piece), name);
      ++report.chunks;
      report.bytes += static_cast<int64_t>(chunk.nbytes);
    }
  }
  return report;
}

}  // namespace hp::dcp
