// Low-precision reductions (WireFormat): the e4m3 codec against its definition, the round trip's
// error bounds, and all_reduce / reduce_scatter equal to the fp32 tree sum of the rounded inputs,
// bitwise, over Gloo and over shared memory.
#include <hp/comm/comm_debug_mode.h>
#include <hp/comm/init.h>
#include <hp/comm/process_group.h>
#include <hp/comm/tree_reduce.h>
#include <hp/comm/wire_format.h>
#include <hp/core/chunking.h>

#include <cmath>
#include <limits>

#include "comm/wire_codec.h"
#include "test_util.h"

namespace hp::test {
namespace {

using comm::ProcessGroup;
using comm::ReduceOp;
using comm::Transport;
using comm::WireFormat;
using comm::detail::e4m3_from_float;
using comm::detail::e4m3_to_float;

bool is_nan_code(int code) { return (code & 0x7f) == 0x7f; }

// e4m3 by its definition: every finite code decodes to (1 + m/8) 2^(e-7), or m 2^-9 when e = 0, and
// encodes back to itself; 0x7f / 0xff are NaN.
TEST(WireFormat, E4M3CodesAreTheirDefinitionAndEncodeBack) {
  for (int code = 0; code < 256; ++code) {
    const float value = e4m3_to_float(static_cast<uint8_t>(code));
    if (is_nan_code(code)) {
      EXPECT_TRUE(std::isnan(value)) << code;
      EXPECT_TRUE(is_nan_code(e4m3_from_float(value))) << code;
      continue;
    }
    const int e = (code >> 3) & 0xf, m = code & 7;
    const double magnitude = e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
    EXPECT_EQ(value, code & 0x80 ? -magnitude : magnitude) << code;
    EXPECT_EQ(e4m3_from_float(value), code) << code << " = " << value;
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
}

// Between two neighbouring codes, a value rounds to the nearer; a tie to the even code (mantissa
// ending in 0); past 448 it saturates.
TEST(WireFormat, E4M3RoundsToNearestEvenAndSaturates) {
  for (int code = 0; code < 0x7e; ++code) {
    const float low = e4m3_to_float(code), high = e4m3_to_float(code + 1);
    const float middle = (low + high) / 2;  // exact: both are short binary fractions
    const int even = code % 2 == 0 ? code : code + 1;
    EXPECT_EQ(e4m3_from_float(middle), even) << "tie between " << low << " and " << high;
    EXPECT_EQ(e4m3_from_float(std::nextafter(middle, 0.0f)), code) << "just below " << middle;
    EXPECT_EQ(e4m3_from_float(std::nextafter(middle, 1e9f)), code + 1) << "just above " << middle;
    EXPECT_EQ(e4m3_from_float(-middle), 0x80 | even) << "negative tie " << -middle;
  }
  for (float big : {448.0f, 463.9f, 464.0f, 1e9f, INFINITY}) EXPECT_EQ(e4m3_from_float(big), 0x7e) << big;
  EXPECT_EQ(e4m3_from_float(-1e9f), 0xfe);
}

// bf16's round trip is ATen's rounding; fp8's error is at most half a step of its block's scale:
// 2^-4 |x| for normal codes, 2^-10 x (block max / 448) below them. A block with an infinity comes
// back as NaNs, its neighbours untouched.
TEST(WireFormat, RoundTripsStayWithinTheirFormatsBounds) {
  const at::Tensor x = at::randn({1000}, at::make_generator<at::CPUGeneratorImpl>(5)) *
                       at::exp(at::randn({1000}, at::make_generator<at::CPUGeneratorImpl>(6)) * 4);
  EXPECT_TRUE(at::equal(comm::wire_round_trip(x, WireFormat::kBf16), x.to(at::kBFloat16).to(at::kFloat)));
  const at::Tensor back = comm::wire_round_trip(x, WireFormat::kFp8E4M3);
  ASSERT_EQ(back.sizes(), x.sizes());
  for (int64_t begin = 0; begin < x.numel(); begin += comm::kFp8BlockValues) {
    const at::Tensor block = x.slice(0, begin, begin + comm::kFp8BlockValues);
    const double scale = block.abs().max().item<double>() / 448;
    const at::Tensor bound =
        (block.abs().to(at::kDouble) * std::ldexp(1.0, -4) + scale * std::ldexp(1.0, -10)) * 1.0001;
    const at::Tensor error = (back.slice(0, begin, begin + comm::kFp8BlockValues).to(at::kDouble) - block).abs();
    EXPECT_TRUE((error <= bound).all().item<bool>()) << "block at " << begin;
  }
  EXPECT_FALSE(at::equal(back, x)) << "fp8 changed nothing: the test would not see a missing rounding";
  at::Tensor with_inf = x.clone();
  with_inf[130] = INFINITY;
  const at::Tensor nan_block = comm::wire_round_trip(with_inf, WireFormat::kFp8E4M3);
  EXPECT_TRUE(nan_block.slice(0, 128, 256).isnan().all().item<bool>());
  EXPECT_TRUE(at::equal(nan_block.slice(0, 0, 128), back.slice(0, 0, 128)));
  EXPECT_TRUE(at::equal(nan_block.slice(0, 256), back.slice(0, 256)));
  // A block near fp32's underflow: its scale stops at fp32's smallest normal, so zeros stay zeros
  // (not 0 / 0) and the bound holds with that scale.
  at::Tensor tiny = x.slice(0, 0, 128) * 1e-41f;
  tiny[3] = 0.0f;
  const at::Tensor tiny_back = comm::wire_round_trip(tiny, WireFormat::kFp8E4M3);
  EXPECT_EQ(tiny_back[3].item<float>(), 0.0f);
  const at::Tensor tiny_bound =
      (tiny.abs().to(at::kDouble) * std::ldexp(1.0, -4) + std::numeric_limits<float>::min() * std::ldexp(1.0, -10)) *
      1.0001;
  EXPECT_TRUE(((tiny_back.to(at::kDouble) - tiny).abs() <= tiny_bound).all().item<bool>());
  EXPECT_EQ(comm::wire_bytes(WireFormat::kFp8E4M3, 129), 2 * 4 + 132);
  EXPECT_EQ(comm::wire_bytes(WireFormat::kBf16, 129), 258);
  EXPECT_EQ(comm::wire_format_named("fp8_e4m3"), WireFormat::kFp8E4M3);
  // A bf16 piece is encoded to fp8 by chunks converted to fp32 in turn: the same codes and scales
  // as the whole piece converted at once, across chunk boundaries (65,536 values each).
  const at::Tensor long_bf16 = at::randn({140001}, at::make_generator<at::CPUGeneratorImpl>(8)).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(comm::wire_round_trip(long_bf16, WireFormat::kFp8E4M3),
                        comm::wire_round_trip(long_bf16.to(at::kFloat), WireFormat::kFp8E4M3)));
  EXPECT_FALSE(comm::wire_format_named("fp8"));
}

// What every member adds for rank r's input: the pieces sent to each member, rounded to the wire
// format and back on their own (fp8 blocks start at each piece), in fp32.
at::Tensor received_values(const at::Tensor& flat, const std::vector<int64_t>& counts, WireFormat wire) {
  std::vector<at::Tensor> pieces;
  int64_t offset = 0;
  for (int64_t count : counts) {
    pieces.push_back(comm::wire_round_trip(flat.narrow(0, offset, count), wire));
    offset += count;
  }
  return at::cat(pieces);
}

testing::RunRanksOptions over(Transport transport) {
  testing::RunRanksOptions options;
  options.group.set_transport(transport);
  return options;
}

// all_reduce (sum and avg) and reduce_scatter (even and uneven, dim 0 and 1) in bf16 and fp8
// equal, bit for bit, the fp32 tree sum of every rank's rounded pieces cast once to the tensor's
// dtype, on 2-4 ranks over Gloo and over shared memory, from empty tensors up.
TEST(LowPrecision, ReductionsEqualTheFp32TreeOfTheRoundedInputsBitwise) {
  for (Transport transport : {Transport::kGloo, Transport::kShm}) {
    for (int world : {2, 3, 4}) {
      run(
          world,
          [&](const ProcessGroup& g) {
            for (WireFormat wire : {WireFormat::kBf16, WireFormat::kFp8E4M3}) {
              for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
                // The last: pieces longer than the 65,536 values a member decodes at a time.
                for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{1001}, 3 * comm::kFp8BlockValues * world + 5,
                                      int64_t{140000} * world}) {
                  const std::string what = comm::to_string(wire) + " " + dtype_name(dtype) + " numel " +
                                           std::to_string(numel) + " on " + std::to_string(world) + " over " +
                                           comm::to_string(transport);
                  std::vector<at::Tensor> inputs, received;
                  for (int r = 0; r < world; ++r) {
                    inputs.push_back(rank_data(r, {numel}, dtype, static_cast<int>(numel)) * 100);
                    received.push_back(received_values(inputs[r], chunk_sizes(numel, world), wire));
                  }
                  const at::Tensor sum = comm::tree_reduce(at::stack(received), ReduceOp::kSum);
                  check_close(g.all_reduce(inputs[g.rank()].clone(), {ReduceOp::kSum, wire}), sum.to(dtype),
                              "all_reduce " + what, /*bitwise=*/true);
                  check_close(g.all_reduce_async(inputs[g.rank()].clone(), {ReduceOp::kAvg, wire}).wait(),
                              (sum / world).to(dtype), "async all_reduce avg " + what, true);
                  comm::ReduceScatterOptions even;  // dim 0, torch.chunk pieces: all_reduce's pieces
                  even.wire = wire;
                  check_close(g.reduce_scatter_async(inputs[g.rank()], even).wait(),
                              sum.narrow(0, chunk_offset(numel, world, g.rank()), chunk_sizes(numel, world)[g.rank()])
                                  .to(dtype),
                              "async reduce_scatter " + what, true);
                }
                // A non-contiguous tensor: reduced in its logical (row-major) order, written back in place.
                std::vector<at::Tensor> by_rows;
                for (int r = 0; r < world; ++r)
                  by_rows.push_back(
                      received_values(rank_data(r, {7, 9}, dtype, 5).t().reshape({-1}), chunk_sizes(63, world), wire));
                at::Tensor transposed = rank_data(g.rank(), {7, 9}, dtype, 5).t();
                EXPECT_FALSE(transposed.is_contiguous());
                check_close(g.all_reduce(transposed, {ReduceOp::kSum, wire}),
                            comm::tree_reduce(at::stack(by_rows), ReduceOp::kSum).view({9, 7}).to(dtype),
                            "non-contiguous all_reduce " + comm::to_string(wire), true);
                // Uneven pieces of a [5, 7] tensor along dim 1: rank r's piece is its columns.
                std::vector<int64_t> sizes(world, 1);
                sizes[0] = 7 - (world - 1);
                std::vector<int64_t> counts;
                for (int64_t s : sizes) counts.push_back(s * 5);
                std::vector<at::Tensor> received;
                for (int r = 0; r < world; ++r) {
                  const at::Tensor columns_first = rank_data(r, {5, 7}, dtype, 9).t().contiguous().view({-1});
                  received.push_back(received_values(columns_first, counts, wire));
                }
                const int64_t offset = g.rank() == 0 ? 0 : sizes[0] + g.rank() - 1;
                const at::Tensor mine = comm::tree_reduce(at::stack(received), ReduceOp::kSum)
                                            .narrow(0, offset * 5, counts[g.rank()])
                                            .view({sizes[g.rank()], 5})
                                            .t();
                comm::ReduceScatterOptions rs;
                rs.dim = 1;
                rs.sizes = sizes;
                rs.wire = wire;
                const at::Tensor input = rank_data(g.rank(), {5, 7}, dtype, 9);
                check_close(g.reduce_scatter(input, rs), mine.to(dtype),
                            "reduce_scatter dim 1 " + comm::to_string(wire), true);
                at::Tensor out = at::empty({5, sizes[g.rank()]}, input.options());
                check_close(g.reduce_scatter_tensor(out, input, rs), mine.to(dtype),
                            "reduce_scatter_tensor dim 1 " + comm::to_string(wire), true);
              }
            }
          },
          over(transport));
    }
  }
}

// Against the exact sum of the fp32 inputs (in fp64), a low-precision all_reduce errs by at most each
// rank's rounding (bf16: 2^-8 |x|; fp8: 2^-4 |x| + 2^-10 of its block's scale) plus fp32's additions.
// bf16 tensors reduced on a bf16 wire add in fp32, so they err less than the native bf16 sum.
TEST(LowPrecision, ErrorAgainstTheExactSumIsWithinTheFormatsBound) {
  constexpr int kWorld = 4;
  constexpr int64_t kNumel = 4096;
  run(kWorld, [&](const ProcessGroup& g) {
    std::vector<at::Tensor> inputs;
    for (int r = 0; r < kWorld; ++r)
      inputs.push_back(rank_data(r, {kNumel}, at::kFloat) *
                       at::exp(rank_data(r, {kNumel}, at::kFloat, /*salt=*/1) * 3));
    const at::Tensor stacked = at::stack(inputs).to(at::kDouble);
    const at::Tensor exact = stacked.sum(0), magnitude = stacked.abs().sum(0);
    const double fp32_adds = kWorld * std::ldexp(1.0, -24);
    const at::Tensor bf16 = g.all_reduce(inputs[g.rank()].clone(), {ReduceOp::kSum, WireFormat::kBf16});
    EXPECT_TRUE(
        ((bf16.to(at::kDouble) - exact).abs() <= magnitude * (std::ldexp(1.0, -8) + fp32_adds)).all().item<bool>());
    // fp8: each block's scale bounds its values' error below the smallest normal code.
    at::Tensor scales = at::zeros({kNumel}, at::kDouble);
    const std::vector<int64_t> pieces = chunk_sizes(kNumel, kWorld);
    for (int r = 0; r < kWorld; ++r)
      for (int64_t begin = 0, piece = 0, piece_end = pieces[0]; begin < kNumel;) {
        const int64_t end = std::min(begin + comm::kFp8BlockValues, piece_end);
        scales.slice(0, begin, end) += stacked[r].slice(0, begin, end).abs().max() / 448;
        begin = end;
        if (begin == piece_end && ++piece < kWorld) piece_end += pieces[piece];
      }
    const at::Tensor fp8 = g.all_reduce(inputs[g.rank()].clone(), {ReduceOp::kSum, WireFormat::kFp8E4M3});
    const at::Tensor fp8_bound = magnitude * (std::ldexp(1.0, -4) + fp32_adds) + scales * std::ldexp(1.0, -10) * 1.0001;
    EXPECT_TRUE(((fp8.to(at::kDouble) - exact).abs() <= fp8_bound).all().item<bool>());
    EXPECT_GT((fp8.to(at::kDouble) - exact).abs().max().item<double>(),
              (bf16.to(at::kDouble) - exact).abs().max().item<double>());

    const at::Tensor mine16 = inputs[g.rank()].to(at::kBFloat16);
    at::Tensor exact16 = at::zeros({kNumel}, at::kDouble);
    for (int r = 0; r < kWorld; ++r) exact16 += inputs[r].to(at::kBFloat16).to(at::kDouble);
    const double native_error = (g.all_reduce(mine16.clone()).to(at::kDouble) - exact16).abs().sum().item<double>();
    const double wire_error =
        (g.all_reduce(mine16.clone(), {ReduceOp::kSum, WireFormat::kBf16}).to(at::kDouble) - exact16)
            .abs()
            .sum()
            .item<double>();
    EXPECT_LT(wire_error, native_error * 0.9) << "bf16 on a bf16 wire should add in fp32";
  });
}

// CommDebugMode counts the reductions that travel on a wire, blocking and async, and a fake world's
// groups (a dry run's) count them alike.
TEST(LowPrecision, CommDebugModeCountsTheReductionsOnAWire) {
  run(2, [](const ProcessGroup& g) {
    comm::CommDebugMode comm;
    g.all_reduce_async(at::ones({4}), {ReduceOp::kSum, WireFormat::kFp8E4M3}).wait();
    g.all_reduce(at::ones({4}));
    comm::ReduceScatterOptions rs;
    rs.wire = WireFormat::kBf16;
    g.reduce_scatter_async(at::ones({4}), rs).wait();
    EXPECT_EQ(comm.count("all_reduce"), 2);
    EXPECT_EQ(comm.on_wire("all_reduce"), 1);
    EXPECT_EQ(comm.on_wire("reduce_scatter"), 1);
    EXPECT_NE(comm.str().find("all_reduce x2 (32 B, 1 on a low-precision wire)"), std::string::npos) << comm.str();
  });
  const ProcessGroup fake = comm::fake_world(4, 1);
  comm::CommDebugMode comm;
  fake.all_reduce(at::ones({8}), {ReduceOp::kSum, WireFormat::kBf16});
  comm::ReduceScatterOptions rs;
  rs.wire = WireFormat::kFp8E4M3;
  fake.reduce_scatter(at::ones({8}), rs);
  EXPECT_EQ(comm.on_wire("all_reduce"), 1);
  EXPECT_EQ(comm.on_wire("reduce_scatter"), 1);
}

TEST(LowPrecision, RefusesWhatItCannotCarry) {
  run(2, [](const ProcessGroup& g) {
    expect_error(
        [&] {
          g.all_reduce(at::ones({4}, at::kDouble), {ReduceOp::kSum, WireFormat::kBf16});
        },
        {"all_reduce: wire format bf16 carries fp32, bf16 or fp16 tensors", "Double"});
    expect_error(
        [&] {
          g.all_reduce(at::ones({4}), {ReduceOp::kMax, WireFormat::kFp8E4M3});
        },
        "all_reduce: wire format fp8_e4m3 is for sum and avg; max is exact in the native format");
    comm::ReduceScatterOptions rs;
    rs.wire = WireFormat::kBf16;
    expect_error([&] { g.reduce_scatter(at::ones({4}, at::kLong), rs); }, "reduce_scatter: wire format bf16 carries");
    g.barrier();  // both ranks refused before any communication: the group is still usable
    EXPECT_EQ(g.all_reduce(at::ones({4}), {ReduceOp::kSum, WireFormat::kBf16}).sum().item<float>(), 8.0f);
  });
}

}  // namespace
}  // namespace hp::test
