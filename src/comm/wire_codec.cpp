#include "comm/wire_codec.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "hp/comm/wire_format.h"
#include "hp/core/error.h"

namespace hp::comm {

std::string to_string(WireFormat format) {
  switch (format) {
    case WireFormat::kNative:
      return "native";
    case WireFormat::kBf16:
      return "bf16";
    case WireFormat::kFp8E4M3:
      return "fp8_e4m3";
  }
  return "?";
}

namespace detail {
namespace {

constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3MaxCode = 0x7e;
constexpr uint8_t kE4M3NaN = 0x7f;

int64_t fp8_blocks(int64_t count) { return (count + kFp8BlockValues - 1) / kFp8BlockValues; }

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int code = 0; code < 256; ++code) {
      const int exponent = (code >> 3) & 0xf, mantissa = code & 0x7;
      float magnitude;
      if (exponent == 0xf && mantissa == 0x7)
        magnitude = std::numeric_limits<float>::quiet_NaN();
      else if (exponent == 0)
        magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m x 2^-9
      else
        magnitude = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      t[code] = code & 0x80 ? -magnitude : magnitude;
    }
    return t;
  }();
  return table;
}

// `count` values of `dtype` at `p` as a 1-D tensor (no copy, no ownership).
at::Tensor view_of(const void* p, int64_t count, at::ScalarType dtype) {
  return at::from_blob(const_cast<void*>(p), {count}, at::TensorOptions().dtype(dtype));
}

}  // namespace

// Both roundings are computed and one is kept, so the cost does not depend on the value.
uint8_t e4m3_from_float(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t sign = (bits >> 24) & 0x80u, magnitude = bits & 0x7fffffffu;
  // Normal (from 2^-6 up): round fp32's 23-bit mantissa to 3 bits, half to even (a carry moves into
  // the exponent), rebias the exponent from 127 to 7, saturate at 448 (e4m3fn has no infinity).
  const uint32_t rounded = magnitude + 0x7ffffu + ((magnitude >> 20) & 1u);
  const uint32_t normal = std::min<uint32_t>((rounded >> 20) - ((127u - 7u) << 3), kE4M3MaxCode);
  // Subnormal (below 2^-6): m x 2^-9. Adding 2^14, whose fp32 spacing is 2^-9, rounds the
  // magnitude to a multiple of 2^-9, half to even, in the FPU; m = 8 is the code of 2^-6.
  float shifted;
  std::memcpy(&shifted, &magnitude, sizeof shifted);
  shifted += 0x1p14f;
  uint32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof shifted_bits);
  const uint32_t subnormal = shifted_bits - 0x46800000u;  // the bits of 2^14
  const uint32_t code = magnitude > 0x7f800000u ? kE4M3NaN : magnitude >= 0x3c800000u ? normal : subnormal;
  return static_cast<uint8_t>(sign | code);
}

float e4m3_to_float(uint8_t code) { return e4m3_table()[code]; }

// `count` fp32 values as fp8 blocks: one scale per block of kFp8BlockValues, one code per value.
void encode_fp8(const float* values, int64_t count, float* scales, uint8_t* codes) {
  for (int64_t block = 0; block < fp8_blocks(count); ++block) {
    const int64_t begin = block * kFp8BlockValues, end = std::min(count, begin + kFp8BlockValues);
    float largest = 0.0f;
    int finite = 1;
    for (int64_t i = begin; i < end; ++i) {
      const float magnitude = std::fabs(values[i]);
      finite &= magnitude <= std::numeric_limits<float>::max();  // false for infinities and NaN
      largest = magnitude > largest ? magnitude : largest;
    }
    // At least the smallest normal fp32: a block of values near fp32's underflow would otherwise get
    // a zero or subnormal scale, and 0 / 0 = NaN codes or values off by far more than the bound.
    const float scale = !finite ? std::numeric_limits<float>::quiet_NaN()
                                : std::max(largest / kE4M3Max, std::numeric_limits<float>::min());
    scales[block] = scale;
    for (int64_t i = begin; i < end; ++i) codes[i] = e4m3_from_float(values[i] / scale);  // NaN scale: NaN codes
  }
}

void encode_piece(WireFormat format, const at::Tensor& piece, std::byte* out) {
  const int64_t count = piece.numel();
  if (count == 0) return;
  if (format == WireFormat::kBf16) {  // ATen's conversion from any dtype: round to nearest even, vectorised
    view_of(out, count, at::kBFloat16).copy_(piece);
    return;
  }
  HP_CHECK(format == WireFormat::kFp8E4M3, "encode_piece: no wire encoding for format ", to_string(format));
  auto* scales = reinterpret_cast<float*>(out);
  auto* codes = reinterpret_cast<uint8_t*>(out + fp8_blocks(count) * sizeof(float));
  if (piece.scalar_type() == at::kFloat) {
    encode_fp8(piece.data_ptr<float>(), count, scales, codes);
  } else {
    for (int64_t begin = 0; begin < count; begin += kCodecChunkValues) {
      const int64_t length = std::min(kCodecChunkValues, count - begin);
      const at::Tensor values = piece.narrow(0, begin, length).to(at::kFloat);
      encode_fp8(values.data_ptr<float>(), length, scales + begin / kFp8BlockValues, codes + begin);
    }
  }
  std::memset(codes + count, 0, wire_bytes(format, count) - fp8_blocks(count) * sizeof(float) - count);
}

void decode_piece(WireFormat format, const std::byte* in, int64_t count, int64_t begin, int64_t length, float* out) {
  HP_CHECK(begin >= 0 && length >= 0 && begin + length <= count && begin % kFp8BlockValues == 0,
           "decode_piece: values [", begin, ", ", begin + length, ") are not a block-aligned range of ", count);
  if (length == 0) return;
  if (format == WireFormat::kBf16) {
    view_of(out, length, at::kFloat).copy_(view_of(in + begin * 2, length, at::kBFloat16));
    return;
  }
  HP_CHECK(format == WireFormat::kFp8E4M3, "decode_piece: no wire encoding for format ", to_string(format));
  const auto* scales = reinterpret_cast<const float*>(in);
  const auto* codes = reinterpret_cast<const uint8_t*>(in + fp8_blocks(count) * sizeof(float));
  const std::array<float, 256>& table = e4m3_table();
  for (int64_t i = begin; i < begin + length; ++i) out[i - begin] = table[codes[i]] * scales[i / kFp8BlockValues];
}

}  // namespace detail

std::optional<WireFormat> wire_format_named(const std::string& name) {
  for (WireFormat format : {WireFormat::kNative, WireFormat::kBf16, WireFormat::kFp8E4M3})
    if (to_string(format) == name) return format;
  return std::nullopt;
}

int64_t wire_bytes(WireFormat format, int64_t count) {
  switch (format) {
    case WireFormat::kBf16:
      return 2 * count;
    case WireFormat::kFp8E4M3:
      return detail::fp8_blocks(count) * static_cast<int64_t>(sizeof(float)) + (count + 3) / 4 * 4;
    case WireFormat::kNative:
      break;
  }
  HP_FAIL("wire_bytes: the native format has no size of its own (it is the tensor's dtype)");
}

at::Tensor wire_round_trip(const at::Tensor& piece, WireFormat format) {
  HP_CHECK(format != WireFormat::kNative, "wire_round_trip: the native format changes nothing; pass bf16 or fp8_e4m3");
  HP_CHECK(piece.is_floating_point(), "wire_round_trip: needs floating-point values, got ", piece.scalar_type());
  HP_CHECK(piece.device().is_cpu(), "wire_round_trip: the formats are emulated on the CPU; got a tensor on ",
           piece.device());
  const at::Tensor values = piece.contiguous().view({-1});
  std::vector<std::byte> bytes(wire_bytes(format, values.numel()));
  detail::encode_piece(format, values, bytes.data());
  at::Tensor back = at::empty(piece.sizes(), at::kFloat);
  detail::decode_piece(format, bytes.data(), values.numel(), 0, values.numel(), back.data_ptr<float>());
  return back;
}

}  // namespace hp::comm
