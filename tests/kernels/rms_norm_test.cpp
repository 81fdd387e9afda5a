// hp::kernels::rms_norm against the composition it replaces in hp::nn::RMSNorm
// (kernels::rms_norm_composed): forward and both gradients within 1e-6 relative to the size of
// each result's terms in fp32, within bf16 rounding of the fp32 composition in bf16, in every
// capability this CPU runs; thread counts do not change a bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <string>
#include <vector>

#include "hp/core/cpu_threads.h"
#include "hp/kernels/rms_norm.h"
#include "kernels/closeness.h"
#include "kernels/per_capability/loops.h"
#include "test_util.h"

namespace hp::test {
namespace {

constexpr double kEps = 1e-6;

// 37 rows of 300 (a partial last vector at every width) with rows of very different scales.
at::Tensor sample(int seed, at::ScalarType dtype = at::kFloat) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor scale = at::exp(at::randn({37, 1}, gen) * 2.0);
  return (at::randn({37, 300}, gen) * scale).to(dtype);
}
at::Tensor weight_sample(int seed, at::ScalarType dtype = at::kFloat) {
  return (1.0 + 0.5 * at::randn({300}, at::make_generator<at::CPUGeneratorImpl>(seed))).to(dtype);
}

struct Result {
  at::Tensor out, dx, dw;
};

template <typename F>
Result run(const F& f, const at::Tensor& x, const at::Tensor& w, const at::Tensor& grad) {
  const at::Tensor xl = x.detach().clone().requires_grad_(true), wl = w.detach().clone().requires_grad_(true);
  const at::Tensor out = f(xl, wl, kEps);
  out.backward(grad);
  return {out.detach(), xl.grad(), wl.grad()};
}

// The terms each result is made of, in fp64: out = x r w; dx = g w r + x r^3 sum|g w x| / d;
// dw = sum over rows |g x r|. A result is held to `tolerance` times these, so one that nearly
// cancels is held to the rounding of its terms.
Result terms(const at::Tensor& x, const at::Tensor& w, const at::Tensor& grad) {
  const at::Tensor x64 = x.to(at::kDouble), w64 = w.to(at::kDouble).abs(), g64 = grad.to(at::kDouble).abs();
  const at::Tensor r = at::rsqrt(x64.pow(2).mean(-1, true) + kEps);
  const at::Tensor dot = (g64 * w64 * x64.abs()).sum(-1, true) / x.size(-1);
  return {x64.abs() * r * w64, g64 * w64 * r + x64.abs() * r.pow(3) * dot, (g64 * x64.abs() * r).sum(0)};
}

void expect_close(const Result& got, const Result& want, const Result& size, double tolerance,
                  const std::string& what) {
  expect_within_terms(got.out, want.out, size.out, tolerance, what + " out");
  expect_within_terms(got.dx, want.dx, size.dx, tolerance, what + " dx");
  expect_within_terms(got.dw, want.dw, size.dw, tolerance, what + " dw");
}

// fp32: within 1e-6 of the terms. bf16: computed in fp32 and rounded once per result (the
// normalised row also once, as the composition rounds it: two roundings of 2^-9), so within 2^-7
// of the terms of the fp32 composition on the same values; the gradients no farther from it than
// the bf16 composition's (which rounds its products on the way).
TEST(RMSNormKernel, MatchesTheComposition) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = sample(1, dtype), w = weight_sample(2, dtype), grad = sample(3, dtype);
    ASSERT_TRUE(kernels::rms_norm_is_fused(x, w));
    const Result fused = run(kernels::rms_norm, x, w, grad), want = run(kernels::rms_norm_composed, x, w, grad);
    const std::string what = std::string(c10::toString(dtype)) + " at capability " + kernels::kernel_capability();
    if (dtype == at::kFloat) {
      expect_close(fused, want, terms(x, w, grad), 1e-6, what);
      continue;
    }
    const at::Tensor x32 = x.to(at::kFloat), w32 = w.to(at::kFloat), g32 = grad.to(at::kFloat);
    const Result fp32 = run(kernels::rms_norm_composed, x32, w32, g32);
    expect_close(fused, fp32, terms(x32, w32, g32), std::ldexp(1.0, -7), what + " against fp32");
    expect_no_farther_from_fp32("dx", fused.dx, want.dx, fp32.dx);
    expect_no_farther_from_fp32("dw", fused.dw, want.dw, fp32.dw);
    // The forward rounds as the composition does: the same bits but where the row's sum of
    // squares, summed in another order, moves rstd by an ulp.
    std::cout << "bf16 out bitwise the composition's: " << (fused.out == want.out).sum().item<int64_t>() << "/"
              << x.numel() << "\n";
  }
}

// Each capability's loops this CPU can run, called directly: fp32 within 1e-6 of the terms, bf16
// within 2^-8 of the terms of the picked capability's (lanes summed in another order).
TEST(RMSNormKernel, EveryCapabilityThisCpuRunsAgrees) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = sample(4, dtype), w = weight_sample(5, dtype), grad = sample(6, dtype);
    const Result want =
        dtype == at::kFloat ? run(kernels::rms_norm_composed, x, w, grad) : run(kernels::rms_norm, x, w, grad);
    for (const kernels::Loops& loops : kernels::runnable_loops()) {
      Result got{at::empty_like(x), at::empty_like(x), at::empty_like(w)};
      const at::Tensor rstd = at::empty({x.size(0)});
      loops.rms_norm_forward(x, w, kEps, got.out, rstd);
      loops.rms_norm_backward(grad, x, w, rstd, got.dx, got.dw);
      if (dtype == at::kFloat) {
        expect_close(got, want, terms(x, w, grad), 1e-6, loops.capability);
      } else {
        // Lanes sum in another order at another width: within one bf16 rounding of the terms.
        expect_close(got, want, terms(x, w, grad), std::ldexp(1.0, -8), std::string("bf16 ") + loops.capability);
      }
    }
  }
}

// 370 rows: 54 rows per task, so every loop splits over the threads.
TEST(RMSNormKernel, ThreadCountsDoNotChangeABit) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = at::cat(std::vector<at::Tensor>(10, sample(7, dtype))), w = weight_sample(8, dtype),
                     grad = at::cat(std::vector<at::Tensor>(10, sample(9, dtype)));
    const Result one = [&] {
      CpuThreadsGuard guard(1);
      return run(kernels::rms_norm, x, w, grad);
    }();
    for (int threads : {2, 3}) {
      CpuThreadsGuard guard(threads);
      const Result got = run(kernels::rms_norm, x, w, grad);
      const std::string what = std::to_string(threads) + " threads";
      EXPECT_TRUE(at::equal(got.out, one.out)) << what;
      EXPECT_TRUE(at::equal(got.dx, one.dx)) << what;
      EXPECT_TRUE(at::equal(got.dw, one.dw)) << what;
    }
  }
}

// Leading dims of any shape, strided inputs; fp64 and mixed dtypes take the composition.
TEST(RMSNormKernel, OtherInputs) {
  const at::Tensor x = sample(10).view({37, 3, 100}).transpose(0, 1).contiguous().transpose(0, 1);
  const at::Tensor w = weight_sample(11).narrow(0, 0, 100),
                   grad = at::randn({37, 3, 100}, at::make_generator<at::CPUGeneratorImpl>(12));
  ASSERT_FALSE(x.is_contiguous());
  const Result a = run(kernels::rms_norm, x, w, grad);
  expect_close(a, run(kernels::rms_norm_composed, x, w, grad), terms(x, w, grad), 1e-6, "strided 3-d");
  EXPECT_EQ(a.dx.sizes(), x.sizes());
  for (const auto& [xi, wi] : {std::pair{x.to(at::kDouble), w.to(at::kDouble)}, std::pair{x.to(at::kBFloat16), w}}) {
    EXPECT_FALSE(kernels::rms_norm_is_fused(xi, wi));
    EXPECT_TRUE(at::equal(kernels::rms_norm(xi, wi, kEps), kernels::rms_norm_composed(xi, wi, kEps)));
  }
}

TEST(RMSNormKernel, DoubleBackwardIsRefused) {
  const at::Tensor x = sample(12).requires_grad_(true), w = weight_sample(13);
  const at::Tensor out = kernels::rms_norm(x, w, kEps).sum();
  expect_error([&] { torch::autograd::grad({out}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true); },
               "no double backward");
}

}  // namespace
}  // namespace hp::test
