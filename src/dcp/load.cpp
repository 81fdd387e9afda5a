// Loading: for each target tensor, intersect this rank's piece (its box in the global tensor) with
// every saved chunk, read the checksum blocks that cover the overlap, verify them and copy the overlap
// into place. Nothing here communicates, so any world size and any layout can load any checkpoint.
#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <memory>

#include "dcp/file_io.h"
#include "dcp/metadata.h"
#include "dcp/safetensors.h"
#include "dcp/xxhash64.h"
#include "hp/core/error.h"
#include "hp/dcp/checkpoint.h"
#include "hp/dtensor/dtensor.h"

namespace hp::dcp {
namespace fs = std::filesystem;
namespace {

using Box = std::pair<std::vector<int64_t>, std::vector<int64_t>>;  // (offsets, sizes)

// Opens each file once per load.
class Files {
 public:
  explicit Files(std::string dir) : dir_(std::move(dir)) {}
  const detail::FileReader& get(const std::string& name) {
    auto& slot = open_[name];
    if (!slot) slot = std::make_unique<detail::FileReader>((fs::path(dir_) / name).string());
    return *slot;
  }

 private:
  std::string dir_;
  std::map<std::string, std::unique_ptr<detail::FileReader>> open_;
};

// Reads bytes [begin, end) of a chunk, widened to whole checksum blocks, and verifies every block.
// Returns the buffer and the chunk byte at which it starts.
std::pair<std::vector<char>, uint64_t> read_verified(Files& files, const detail::ChunkRecord& chunk,
                                                     uint64_t block_bytes, uint64_t begin, uint64_t end,
                                                     const std::string& tensor) {
  const uint64_t first_block = begin / block_bytes;
  const uint64_t start = first_block * block_bytes;
  const uint64_t stop = std::min(chunk.nbytes, (end + block_bytes - 1) / block_bytes * block_bytes);
  std::vector<char> buffer(stop - start);
  const detail::FileReader& file = files.get(chunk.file);
  try {
    file.read_at(buffer.data(), buffer.size(), chunk.byte_offset + start);
  } catch (const Error& e) {
    HP_FAIL(e.what(), " (tensor '", tensor, "')");
  }
  for (uint64_t at = start, b = first_block; at < stop; at += block_bytes, ++b) {
    const uint64_t n = std::min(block_bytes, stop - at);
    HP_CHECK(detail::xxhash64(buffer.data() + (at - start), n) == chunk.checksums[b], "dcp: checksum mismatch in ",
             file.path(), " (tensor '", tensor, "', chunk bytes ", at, "..", at + n,
             "): the checkpoint is damaged");
  }
  return {std::move(buffer), start};
}

// Row-major element index of `index` in a box of `sizes`.
int64_t linear_index(const std::vector<int64_t>& index, const std::vector<int64_t>& sizes) {
  int64_t at = 0;
  for (size_t d = 0; d < sizes.size(); ++d) at = at * sizes[d] + index[d];
  return at;
}

// Copies the part of `chunk` that overlaps `target_box` into `target` (the tensor holding that box).
// Returns the number of elements copied.
int64_t copy_overlap(Files& files, const detail::ChunkRecord& chunk, const detail::TensorRecord& record,
                     uint64_t block_bytes, const Box& target_box, at::Tensor& target, const std::string& name) {
  const size_t ndim = record.shape.size();
  std::vector<int64_t> lo(ndim), hi(ndim), extent(ndim);
  int64_t count = 1;
  for (size_t d = 0; d < ndim; ++d) {
    lo[d] = std::max(chunk.offsets[d], target_box.first[d]);
    hi[d] = std::min(chunk.offsets[d] + chunk.sizes[d], target_box.first[d] + target_box.second[d]);
    if (hi[d] <= lo[d]) return 0;
    extent[d] = hi[d] - lo[d];
    count *= extent[d];
  }
  std::vector<int64_t> first(ndim), last(ndim), strides(ndim, 1);
  for (size_t d = 0; d < ndim; ++d) {
    first[d] = lo[d] - chunk.offsets[d];
    last[d] = hi[d] - 1 - chunk.offsets[d];
  }
  for (int64_t d = static_cast<int64_t>(ndim) - 2; d >= 0; --d) strides[d] = strides[d + 1] * chunk.sizes[d + 1];
  const uint64_t element = detail::dtype_bytes(record.dtype);
  const int64_t first_element = linear_index(first, chunk.sizes);
  auto [buffer, start] = read_verified(files, chunk, block_bytes, first_element * element,
                                       (linear_index(last, chunk.sizes) + 1) * element, name);
  const at::Tensor bytes = at::from_blob(buffer.data(), {static_cast<int64_t>(buffer.size() / element)},
                                         at::TensorOptions().dtype(detail::scalar_type_of(record.dtype)));
  const at::Tensor source = bytes.as_strided(extent, strides, first_element - static_cast<int64_t>(start / element));
  at::Tensor dest = target;
  for (size_t d = 0; d < ndim; ++d) dest = dest.narrow(d, lo[d] - target_box.first[d], extent[d]);
  dest.copy_(source);
  return count;
}

void load_tensor(Files& files, const detail::Metadata& m, const std::string& dir, const std::string& name,
                 at::Tensor& tensor) {
  const auto it = m.tensors.find(name);
  HP_CHECK(it != m.tensors.end(), "dcp.load: the checkpoint in ", dir, " has no tensor '", name, "'");
  const detail::TensorRecord& record = it->second;
  HP_CHECK(record.shape == tensor.sizes().vec(), "dcp.load: tensor '", name, "' has shape ", tensor.sizes(),
           " but the checkpoint in ", dir, " holds shape ", c10::IntArrayRef(record.shape));
  HP_CHECK(detail::scalar_type_of(record.dtype) == tensor.scalar_type(), "dcp.load: tensor '", name, "' is ",
           tensor.scalar_type(), " but the checkpoint holds ", record.dtype);
  at::Tensor target = tensor;
  Box box{std::vector<int64_t>(record.shape.size(), 0), record.shape};
  if (is_dtensor(tensor)) {
    const DTensor d(tensor);
    for (const auto& p : d.placements())
      HP_CHECK(!p.is_partial(), "dcp.load: tensor '", name, "' is Partial; load into Replicate or Shard placements");
    const auto coordinate = d.device_mesh().get_coordinate();
    if (!coordinate) return;  // this rank holds no piece of it
    auto [shape, offsets] = d.spec().local_shape_and_offset(*coordinate);
    box = {offsets, shape};
    target = d.to_local();
  }
  int64_t need = 1;
  for (int64_t s : box.second) need *= s;
  int64_t got = 0;
  at::NoGradGuard no_grad;
  for (const auto& chunk : record.chunks)
    got += copy_overlap(files, chunk, record, m.checksum_block_bytes, box, target, name);
  HP_CHECK(got == need, "dcp.load: tensor '", name, "': the checkpoint covers ", got, " of this rank's ", need,
           " elements");
}

}  // namespace

void load(StateDict& state, const std::string& dir) {
  const detail::Metadata m = detail::read_metadata(dir);
  Files files(dir);
  for (auto& [name, tensor] : state.tensors) {
    HP_CHECK(tensor.defined(), "dcp.load: tensor '", name, "' is undefined");
    load_tensor(files, m, dir, name, tensor);
  }
  state.values = m.values;
}

VerifyReport verify(const std::string& dir) {
  const detail::Metadata m = detail::read_metadata(dir);
  Files files(dir);
  VerifyReport report;
  std::map<std::string, bool> headers_checked;
  for (const auto& [name, record] : m.tensors) {
    ++report.tensors;
    for (const auto& chunk : record.chunks) {
      if (!headers_checked[chunk.file]) {
        detail::read_safetensors_header((fs::path(dir) / chunk.file).string());
        headers_checked[chunk.file] = true;
      }
      for (uint64_t at = 0; at < chunk.nbytes; at += size_t{64} << 20)
        read_verified(files, chunk, m.checksum_block_bytes, at, std::min(chunk.nbytes, at + (uint64_t{64} << 20)), name);
      ++report.chunks;
      report.bytes += static_cast<int64_t>(chunk.nbytes);
    }
  }
  return report;
}

}  // namespace hp::dcp
