// Encoding the pieces of a low-precision reduction (hp::comm::WireFormat) to bytes and back.
//
// On the wire a piece of n values is, in kBf16, n bf16 values; in kFp8E4M3, the fp32 scales of its
// ceil(n / 128) blocks, then one e4m3 code per value, padded to a multiple of 4 bytes so that the
// next piece's scales stay aligned.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

#include "hp/comm/types.h"
#include "hp/comm/wire_format.h"

namespace hp::comm::detail {

// Values the codec converts to or from fp32 at a time (a multiple of kFp8BlockValues): a piece in
// another dtype is encoded, and received pieces are decoded, this many values at a time, so that
// no whole fp32 copy of the data is made.
constexpr int64_t kCodecChunkValues = 512 * kFp8BlockValues;

// A contiguous 1-D piece of floating-point values (on the CPU) into wire_bytes(format, numel)
// bytes at `out`.
void encode_piece(WireFormat format, const at::Tensor& piece, std::byte* out);
// The inverse, for values [begin, begin + length) of a piece of `count` values encoded at `in`
// (`begin` a multiple of kFp8BlockValues), into fp32 at `out`.
void decode_piece(WireFormat format, const std::byte* in, int64_t count, int64_t begin, int64_t length, float* out);

// fp8 e4m3 (OCP "e4m3fn": bias 7, no infinities, 0x7f and 0xff are NaN, largest finite 448):
// round to nearest even, saturating at +-448; NaN stays NaN.
uint8_t e4m3_from_float(float value);
float e4m3_to_float(uint8_t code);

}  // namespace hp::comm::detail
