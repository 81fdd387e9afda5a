// The device build's flash attention (default_attention_kernel) against the blockwise kernel on the
// same GPU inputs: in bf16 with grouped-query heads, out, lse and the three gradients agree within
// stated tolerances; the problems flash does not compute alike (shuffled positions, fp32) go to the
// blockwise kernel and give its results bitwise. Skipped where the build has no HP_CUDA or no GPU is
// visible.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "has_gpu.h"
#include "hp/nn/attention.h"

namespace hp::nn {
namespace {

struct Inputs {
  at::Tensor q, k, v, dout;
};

// q [b, hq, s, d], k and v [b, hkv, s, d], dout like the output; seeded, on the GPU.
Inputs inputs(int64_t b, int64_t hq, int64_t hkv, int64_t s, int64_t d, at::ScalarType dtype) {
  at::manual_seed(11);
  const auto make = [&](int64_t heads) { return at::randn({b, heads, s, d}).to(at::kCUDA, dtype); };
  return {make(hq), make(hkv), make(hkv), make(hq)};
}

struct Results {
  AttentionOutput forward;
  AttentionGrads grads;
};

Results run(const AttentionKernel& kernel, const Inputs& in, const AttentionMask& mask, double scale) {
  Results r;
  r.forward = kernel.forward(in.q, in.k, in.v, mask, scale);
  const at::Tensor out = r.forward.out.to(in.q.scalar_type());  // as hp::nn::attention keeps it
  r.grads = kernel.backward(in.q, in.k, in.v, out, r.forward.lse, in.dout, mask, scale);
  return r;
}

// max |got - want| / max |want|, printed and held to `rtol`.
void expect_relative(const at::Tensor& got, const at::Tensor& want, double rtol, const char* what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double largest = want.abs().max().item<double>();
  const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>() / largest;
  std::printf("flash against blockwise, %s: largest difference %.3g of the largest value (tolerance %.3g)\n", what,
              diff, rtol);
  EXPECT_LE(diff, rtol) << what;
}

void expect_bitwise(const Results& got, const Results& want, const std::string& what) {
  EXPECT_TRUE(at::equal(got.forward.out, want.forward.out)) << what << ": out";
  EXPECT_TRUE(at::equal(got.forward.lse, want.forward.lse)) << what << ": lse";
  EXPECT_TRUE(at::equal(got.grads.dq, want.grads.dq)) << what << ": dq";
  EXPECT_TRUE(at::equal(got.grads.dk, want.grads.dk)) << what << ": dk";
  EXPECT_TRUE(at::equal(got.grads.dv, want.grads.dv)) << what << ": dv";
}

// Flash's out, lse and gradients are the blockwise kernel's within a few bf16 roundings, causal or not,
// with grouped-query heads and a length that is no multiple of the blockwise kernel's block.
TEST(FusedAttention, FlashAgreesWithTheBlockwiseKernelInBf16) {
  if (!test::has_gpu()) GTEST_SKIP() << "no GPU in this build or on this machine";
  const Inputs in = inputs(2, 8, 2, 300, 64, at::kBFloat16);  // 4 query heads per key/value head
  const double scale = 0.125;
  for (const bool causal : {true, false}) {
    const AttentionMask mask{causal, {}, {}, {}};
    const Results flash = run(*default_attention_kernel(), in, mask, scale);
    const Results blockwise = run(*cpu_attention_kernel(), in, mask, scale);
    SCOPED_TRACE(causal ? "causal" : "not causal");
    // Both take bf16 factors with fp32 sums; the blockwise kernel also rounds each block's scores to
    // bf16, so the two differ by a few bf16 roundings (2^-8 relative each).
    expect_relative(flash.forward.out, blockwise.forward.out, 2e-2, "out");
    expect_relative(flash.forward.lse, blockwise.forward.lse, 1e-2, "lse");
    expect_relative(flash.grads.dq, blockwise.grads.dq, 3e-2, "dq");
    expect_relative(flash.grads.dk, blockwise.grads.dk, 3e-2, "dk");
    expect_relative(flash.grads.dv, blockwise.grads.dv, 2e-2, "dv");
    // Another kernel ran (not the blockwise one twice, as with HP_ATTENTION_KERNEL=blockwise).
    EXPECT_FALSE(at::equal(flash.forward.out, blockwise.forward.out));
    EXPECT_EQ(flash.forward.out.scalar_type(), at::kFloat);
    EXPECT_EQ(flash.grads.dk.sizes(), in.k.sizes());
  }
}

// A problem flash would mask or round differently runs the blockwise kernel: its results, bitwise.
TEST(FusedAttention, WhatFlashDoesNotComputeAlikeGoesToTheBlockwiseKernel) {
  if (!test::has_gpu()) GTEST_SKIP() << "no GPU in this build or on this machine";
  const auto blockwise = cpu_attention_kernel();
  const auto fused = default_attention_kernel();
  // A context-parallel shard's positions: causal masking by position, which flash cannot do.
  const Inputs bf16 = inputs(1, 4, 2, 64, 32, at::kBFloat16);
  const at::Tensor shuffled = at::randperm(64, at::kLong);
  const AttentionMask by_position{true, shuffled, shuffled, {}};
  expect_bitwise(run(*fused, bf16, by_position, 0.2), run(*blockwise, bf16, by_position, 0.2), "shuffled positions");
  // fp32 (flash takes bf16 and fp16 only).
  const Inputs fp32 = inputs(1, 4, 2, 64, 32, at::kFloat);
  const AttentionMask causal{true, {}, {}, {}};
  expect_bitwise(run(*fused, fp32, causal, 0.2), run(*blockwise, fp32, causal, 0.2), "fp32");
}

}  // namespace
}  // namespace hp::nn
