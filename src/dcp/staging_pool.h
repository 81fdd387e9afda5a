// Staging memory for async saves, kept from one save to the next.
//
// A copy into fresh pages costs about twice a copy into pages already touched (the kernel zeroes
// and maps each new page), and a trainer saves the same tensors at every checkpoint. So staging
// buffers go back to a process-wide pool when the writer is done with them, and the next save of
// the same sizes copies into warm memory (as torch DCP caches its staging state dict). The pool
// holds at most what the largest save staged at once (bounded by SaveOptions::max_staging_bytes).
#pragma once

#include <ATen/core/Tensor.h>

namespace hp::dcp::detail {

// A contiguous CPU tensor of `like`'s dtype and shape, from the pool when a free buffer fits.
at::Tensor acquire_staging(const at::Tensor& like);
// Gives a tensor from acquire_staging back to the pool.
void release_staging(at::Tensor staged);
// Bytes the pool holds (in use or free), for tests and benchmarks.
size_t staging_pool_bytes();

}  // namespace hp::dcp::detail
