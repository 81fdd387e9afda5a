// XXH64 (Yann Collet's xxHash, 64-bit): the checksum of checkpoint data blocks. Fast enough
// (several GB/s) that verifying every block read costs little next to the read itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hp::dcp::detail {

uint64_t xxhash64(const void* data, size_t length, uint64_t seed = 0);
std::string hex64(uint64_t value);  // 16 lowercase hex digits

}  // namespace hp::dcp::detail
