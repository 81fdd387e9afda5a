// A rank's state packed into one byte tensor (src/train/memory_checkpointing.h): it comes back
// bitwise into tensors of the same names, dtypes and shapes, with its values; a state of another
// layout is refused naming the tensor; and the checksum sees a single byte changed anywhere.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "hp/core/error.h"
#include "train/memory_checkpointing.h"

namespace hp::train::detail {
namespace {

dcp::StateDict some_state() {
  dcp::StateDict state;
  state.tensors["model.a"] = at::randn({3, 5});
  state.tensors["model.b"] = at::arange(7, at::kLong);
  state.tensors["optim.a.exp_avg"] = at::randn({3, 5}).to(at::kBFloat16);
  state.values = {{"step", 8}, {"mesh_rng", {{"seed", 42}}}};
  return state;
}

dcp::StateDict zeros_like(const dcp::StateDict& state) {
  dcp::StateDict out;
  for (const auto& [name, t] : state.tensors) out.tensors[name] = at::zeros_like(t);
  return out;
}

TEST(PackedState, ComesBackBitwiseWithItsValues) {
  const dcp::StateDict state = some_state();
  dcp::StateDict back = zeros_like(state);
  unpack_state(pack_state(state), back);
  for (const auto& [name, t] : state.tensors) EXPECT_TRUE(at::equal(back.tensors.at(name), t)) << name;
  EXPECT_EQ(back.values, state.values);
}

TEST(PackedState, AStateOfAnotherLayoutIsRefused) {
  const dcp::StateDict state = some_state();
  dcp::StateDict other = zeros_like(state);
  other.tensors["model.a"] = at::zeros({5, 3});
  try {
    unpack_state(pack_state(state), other);
    ADD_FAILURE() << "unpacked into another layout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.a is packed as Float [3, 5] but this rank holds Float [5, 3]"),
              std::string::npos)
        << e.what();
  }
}

// Guards what a recovery relies on to resend a damaged copy: any one byte changed changes the sum.
TEST(PackedState, TheChecksumSeesOneByteChangedAnywhere) {
  const at::Tensor packed = pack_state(some_state());
  const uint64_t sum = packed_checksum(packed);
  for (int64_t at = 0; at < packed.numel(); ++at)
    for (uint8_t bit : {uint8_t{1}, uint8_t{0x80}}) {
      at::Tensor changed = packed.clone();
      static_cast<uint8_t*>(changed.data_ptr())[at] ^= bit;
      ASSERT_NE(packed_checksum(changed), sum) << "byte " << at << ", bit " << int(bit);
    }
}

}  // namespace
}  // namespace hp::train::detail
