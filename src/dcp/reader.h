// Reading tensors out of chunked files: the part of loading shared by hp::dcp checkpoints (chunks
// with per-block checksums) and Hugging Face safetensors imports (one unchecked chunk per tensor).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <utility>

#include "dcp/file_io.h"
#include "dcp/metadata.h"

namespace hp::dcp::detail {

// Opens each file of a directory once.
class Files {
 public:
  explicit Files(std::string dir) : dir_(std::move(dir)) {}
  const FileReader& get(const std::string& name);

 private:
  std::string dir_;
  std::map<std::string, std::unique_ptr<FileReader>> open_;
};

// Reads bytes [begin, end) of a chunk, widened to whole checksum blocks, and verifies every block
// (block_bytes 0: no checksums, the exact range).
struct ChunkBytes {
  std::unique_ptr<char[]> data;
  uint64_t start = 0, size = 0;  // the chunk bytes data holds
};
ChunkBytes read_verified(Files& files, const ChunkRecord& chunk, uint64_t block_bytes, uint64_t begin, uint64_t end,
                         const std::string& tensor);
// Reads chunk bytes [start, stop) into `out` and verifies every block (start on a block boundary).
void read_range(Files& files, const ChunkRecord& chunk, uint64_t block_bytes, uint64_t start, uint64_t stop, char* out,
                const std::string& tensor);

// Fills `tensor` from `record`'s chunks: a DTensor's local piece (this rank's box of the global
// tensor), a plain tensor whole. Reads only the chunks that overlap. `where` names the source in errors.
// The dtypes must match, or, with convert_floats, both be floating types (the values are converted
// as Tensor::copy_ converts them).
void read_tensor(Files& files, const TensorRecord& record, uint64_t block_bytes, const std::string& name,
                 at::Tensor& tensor, const std::string& where, bool convert_floats = false);

}  // namespace hp::dcp::detail
