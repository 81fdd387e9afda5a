// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// counter-based generator, so value i is computed directly from (key, counter i), in any order,
// on any rank. Random fills by global position (hp::philox_fill, hp/dtensor/random.h) use it.
#pragma once

#include <array>
#include <cstdint>

namespace hp::detail {

inline std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * counter[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * counter[2];
    counter = {static_cast<uint32_t>(p1 >> 32) ^ counter[1] ^ key[0], static_cast<uint32_t>(p1),
               static_cast<uint32_t>(p0 >> 32) ^ counter[3] ^ key[1], static_cast<uint32_t>(p0)};
    key = {key[0] + kW0, key[1] + kW1};
  }
  return counter;
}

}  // namespace hp::detail
