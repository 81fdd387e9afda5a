// What a low-precision reduction (hp::comm::WireFormat, hp/comm/types.h) does to the values it
// carries, for callers that need to predict or bound its result.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "hp/comm/types.h"

namespace hp::comm {

// Values per fp8 scale: each block of this many values, counted from the start of the piece a
// rank sends to one member, is scaled so that its largest magnitude becomes e4m3's largest, 448.
constexpr int64_t kFp8BlockValues = 128;

// The format to_string names `name` ("native", "bf16", "fp8_e4m3"), or nullopt.
std::optional<WireFormat> wire_format_named(const std::string& name);

// The bytes a piece of `count` values takes on the wire in `format` (kNative: not defined; use
// the tensor's own size).
int64_t wire_bytes(WireFormat format, int64_t count);

// What the members of a reduction add for `piece` sent in `format`: its values rounded to the
// format and back, as an fp32 tensor of piece's shape (fp8 blocks in flat order from piece's
// first value). A block holding an infinity or a NaN comes back as NaNs, so that a check for
// non-finite gradients still sees it. CPU tensors only (the formats are emulated).
at::Tensor wire_round_trip(const at::Tensor& piece, WireFormat format);

}  // namespace hp::comm
