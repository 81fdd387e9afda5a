#include "dcp/reader.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "dcp/safetensors.h"
#include "dcp/xxhash64.h"
#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"

namespace hp::dcp::detail {
namespace {

using Box = std::pair<std::vector<int64_t>, std::vector<int64_t>>;  // (offsets, sizes)

// Row-major element index of `index` in a box of `sizes`.
int64_t linear_index(const std::vector<int64_t>& index, const std::vector<int64_t>& sizes) {
  int64_t at = 0;
  for (size_t d = 0; d < sizes.size(); ++d) at = at * sizes[d] + index[d];
  return at;
}

// Copies the part of `chunk` that overlaps `target_box` into `target` (the tensor holding that box).
// Returns the number of elements copied.
int64_t copy_overlap(Files& files, const ChunkRecord& chunk, const TensorRecord& record, uint64_t block_bytes,
                     const Box& target_box, at::Tensor& target, const std::string& name) {
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
  at::Tensor dest = target;
  for (size_t d = 0; d < ndim; ++d) dest = dest.narrow(d, lo[d] - target_box.first[d], extent[d]);
  // The whole chunk into contiguous host memory of its dtype (resuming in the saved layout): read
  // straight into place. Otherwise through a buffer, converting the dtype (and device) on the copy.
  if (extent == chunk.sizes && dest.is_cpu() && dest.is_contiguous() &&
      dest.scalar_type() == scalar_type_of(record.dtype)) {
    read_range(files, chunk, block_bytes, 0, chunk.nbytes, static_cast<char*>(dest.data_ptr()), name);
    return count;
  }
  const uint64_t element = dtype_bytes(record.dtype);
  const int64_t first_element = linear_index(first, chunk.sizes);
  const uint64_t end = (linear_index(last, chunk.sizes) + 1) * element;
  const ChunkBytes span = read_verified(files, chunk, block_bytes, first_element * element, end, name);
  const at::Tensor bytes = at::from_blob(span.data.get(), {static_cast<int64_t>(span.size / element)},
                                         at::TensorOptions().dtype(scalar_type_of(record.dtype)));
  dest.copy_(bytes.as_strided(extent, strides, first_element - static_cast<int64_t>(span.start / element)));
  return count;
}

}  // namespace

const FileReader& Files::get(const std::string& name) {
  auto& slot = open_[name];
  if (!slot) slot = std::make_unique<FileReader>((std::filesystem::path(dir_) / name).string());
  return *slot;
}

void read_range(Files& files, const ChunkRecord& chunk, uint64_t block_bytes, uint64_t start, uint64_t stop, char* out,
                const std::string& tensor) {
  const FileReader& file = files.get(chunk.file);
  try {
    file.read_at(out, stop - start, chunk.byte_offset + start);
  } catch (const Error& e) {
    HP_FAIL(e.what(), " (tensor '", tensor, "')");
  }
  for (uint64_t at = start, b = block_bytes ? start / block_bytes : 0; block_bytes && at < stop;
       at += block_bytes, ++b) {
    const uint64_t n = std::min(block_bytes, stop - at);
    HP_CHECK(xxhash64(out + (at - start), n) == chunk.checksums[b], "dcp: checksum mismatch in ", file.path(),
             " (tensor '", tensor, "', chunk bytes ", at, "..", at + n, "): the checkpoint is damaged");
  }
}

ChunkBytes read_verified(Files& files, const ChunkRecord& chunk, uint64_t block_bytes, uint64_t begin, uint64_t end,
                         const std::string& tensor) {
  // Widened to whole checksum blocks; without checksums (block_bytes 0: files written by other
  // tools) the read is exact.
  const uint64_t start = block_bytes ? begin / block_bytes * block_bytes : begin;
  const uint64_t stop = block_bytes ? std::min(chunk.nbytes, (end + block_bytes - 1) / block_bytes * block_bytes) : end;
  ChunkBytes bytes{std::unique_ptr<char[]>(new char[stop - start]), start, stop - start};  // filled by the read
  read_range(files, chunk, block_bytes, start, stop, bytes.data.get(), tensor);
  return bytes;
}

void read_tensor(Files& files, const TensorRecord& record, uint64_t block_bytes, const std::string& name,
                 at::Tensor& tensor, const std::string& where, bool convert_floats) {
  HP_CHECK(record.shape == tensor.sizes().vec(), "dcp.load: tensor '", name, "' has shape ", tensor.sizes(), " but ",
           where, " holds shape ", c10::IntArrayRef(record.shape));
  const at::ScalarType stored = scalar_type_of(record.dtype);
  HP_CHECK(stored == tensor.scalar_type() ||
               (convert_floats && at::isFloatingType(stored) && at::isFloatingType(tensor.scalar_type())),
           "dcp.load: tensor '", name, "' is ", tensor.scalar_type(), " but ", where, " holds ", record.dtype);
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
  for (const auto& chunk : record.chunks) got += copy_overlap(files, chunk, record, block_bytes, box, target, name);
  HP_CHECK(got == need, "dcp.load: tensor '", name, "': ", where, " covers ", got, " of this rank's ", need,
           " elements");
}

}  // namespace hp::dcp::detail
