// hp::kernels::rope against its composition (kernels::rope_composed, what the Llama attention
// computed): forward and gradient within 1e-6 relative to each result's terms in fp32; in bf16
// within two roundings of fp32's and no farther from it than the bf16 composition (which rounds the
// tables and every product); every capability this CPU runs; thread counts do not change a bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <string>

#include "hp/core/cpu_threads.h"
#include "hp/kernels/rope.h"
#include "kernels/closeness.h"
#include "kernels/per_capability/loops.h"
#include "test_util.h"

namespace hp::test {
namespace {

// [3, 37, 5, 70]: half a head (35) ends in a partial vector at every width; 555 rows of heads.
at::Tensor sample(int seed, at::ScalarType dtype = at::kFloat) {
  return (at::randn({3, 37, 5, 70}, at::make_generator<at::CPUGeneratorImpl>(seed)) * 4.0).to(dtype);
}

// Table rows for positions out of order (a context-parallel shard's), fp32 [37, 70], with a
// frequency per column: a Llama table repeats its frequencies in both halves, which would hide a
// kernel that took one half's sine for the other's.
std::pair<at::Tensor, at::Tensor> tables() {
  const at::Tensor positions = at::randperm(100, at::make_generator<at::CPUGeneratorImpl>(7)).narrow(0, 0, 37);
  const at::Tensor inv_freq = at::pow(10000.0, -at::arange(0, 70, at::kDouble) / 70);
  const at::Tensor angles = at::outer(positions.to(at::kDouble), inv_freq);
  return {angles.cos().to(at::kFloat), angles.sin().to(at::kFloat)};
}

struct Result {
  at::Tensor out, dx;
};

template <typename F>
Result run(const F& f, const at::Tensor& x, const at::Tensor& grad) {
  const auto [cos, sin] = tables();
  const at::Tensor leaf = x.detach().clone().requires_grad_(true);
  const at::Tensor out = f(leaf, cos, sin);
  out.backward(grad);
  return {out.detach(), leaf.grad()};
}

// Terms: |x| |cos| + |rotated x| |sin| per element (and the same of the gradient's transpose,
// bounded by |g| + |g of the other half| since |cos|, |sin| <= 1).
at::Tensor terms(const at::Tensor& t) {
  const at::Tensor a = t.to(at::kDouble).abs();
  return a + at::cat({a.narrow(-1, 35, 35), a.narrow(-1, 0, 35)}, -1);
}

void expect_close(const Result& got, const Result& want, const at::Tensor& x, const at::Tensor& grad, double tolerance,
                  const std::string& what) {
  expect_within_terms(got.out, want.out, terms(x), tolerance, what + " out");
  expect_within_terms(got.dx, want.dx, terms(grad), tolerance, what + " dx");
}

TEST(RopeKernel, MatchesTheComposition) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor x = sample(1, dtype), grad = sample(2, dtype);
    const auto [cos, sin] = tables();
    ASSERT_TRUE(kernels::rope_is_fused(x, cos, sin));
    const Result fused = run(kernels::rope, x, grad), want = run(kernels::rope_composed, x, grad);
    const std::string what = std::string(c10::toString(dtype)) + " at capability " + kernels::kernel_capability();
    if (dtype == at::kFloat) {
      expect_close(fused, want, x, grad, 1e-6, what);
      continue;
    }
    const at::Tensor x32 = x.to(at::kFloat), g32 = grad.to(at::kFloat);
    const Result fp32 = run(kernels::rope_composed, x32, g32);
    expect_close(fused, fp32, x32, g32, std::ldexp(1.0, -8), what + " against fp32");
    expect_no_farther_from_fp32("out", fused.out, want.out, fp32.out);
    expect_no_farther_from_fp32("dx", fused.dx, want.dx, fp32.dx);
  }
}

TEST(RopeKernel, EveryCapabilityThisCpuRunsAgrees) {
  const at::Tensor x = sample(3), grad = sample(4);
  const auto [cos, sin] = tables();
  const Result want = run(kernels::rope_composed, x, grad);
  for (const kernels::Loops& loops : kernels::runnable_loops()) {
    Result got{at::empty_like(x), at::empty_like(x)};
    loops.rope(x, cos, sin, 37, 5, /*transpose=*/false, got.out);
    loops.rope(grad, cos, sin, 37, 5, /*transpose=*/true, got.dx);
    expect_close(got, want, x, grad, 1e-6, loops.capability);
  }
}

TEST(RopeKernel, ThreadCountsDoNotChangeABit) {
  const at::Tensor x = sample(5, at::kBFloat16), grad = sample(6, at::kBFloat16);
  const Result one = [&] {
    CpuThreadsGuard guard(1);
    return run(kernels::rope, x, grad);
  }();
  for (int threads : {2, 3}) {
    CpuThreadsGuard guard(threads);
    const Result got = run(kernels::rope, x, grad);
    EXPECT_TRUE(at::equal(got.out, one.out)) << threads << " threads";
    EXPECT_TRUE(at::equal(got.dx, one.dx)) << threads << " threads";
  }
}

// fp64 takes the composition; a double backward is refused.
TEST(RopeKernel, OtherInputs) {
  const auto [cos, sin] = tables();
  const at::Tensor x64 = sample(8, at::kDouble);
  EXPECT_FALSE(kernels::rope_is_fused(x64, cos, sin));
  EXPECT_TRUE(at::equal(kernels::rope(x64, cos, sin), kernels::rope_composed(x64, cos, sin)));
  const at::Tensor x = sample(9).requires_grad_(true);
  const at::Tensor out = kernels::rope(x, cos, sin).sum();
  expect_error([&] { torch::autograd::grad({out}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true); },
               "no double backward");
}

}  // namespace
}  // namespace hp::test
