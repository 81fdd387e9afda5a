// hp::kernels::swiglu against ATen's composition at::silu(gate) * up: forward and both gradients
// within 1e-6 relative to the size of each result's terms (and mostly bitwise, counted), in fp32
// and bf16 and in every capability this CPU runs; thread counts do not change a bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <string>
#include <vector>

#include "hp/core/cpu_threads.h"
#include "hp/kernels/swiglu.h"
#include "kernels/closeness.h"
#include "kernels/per_capability/loops.h"
#include "test_util.h"

namespace hp::test {
namespace {

// 3 x 12347 elements: several tasks of the parallel loop and a partial last vector.
at::Tensor sample(int seed, at::ScalarType dtype = at::kFloat) {
  return (at::randn({3, 12347}, at::make_generator<at::CPUGeneratorImpl>(seed)) * 3.0).to(dtype);
}

struct Result {
  at::Tensor out, dgate, dup;
};

// out and the gradients of sum(out * w) through `f`.
template <typename F>
Result run(const F& f, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& w) {
  const at::Tensor g = gate.detach().clone().requires_grad_(true), u = up.detach().clone().requires_grad_(true);
  const at::Tensor out = f(g, u);
  (out * w).sum().backward();
  return {out.detach(), g.grad(), u.grad()};
}

at::Tensor composed(const at::Tensor& g, const at::Tensor& u) { return at::silu(g) * u; }

// Fused and composed, forward and both gradients, bitwise.
void expect_bitwise(const Result& fused, const Result& want, const std::string& what) {
  EXPECT_TRUE(at::equal(fused.out, want.out)) << what << " out";
  EXPECT_TRUE(at::equal(fused.dgate, want.dgate)) << what << " dgate";
  EXPECT_TRUE(at::equal(fused.dup, want.dup)) << what << " dup";
}

// Each result within 1e-6 of its terms (fp32; bf16: within the bf16 rounding of its terms).
void expect_close(const Result& got, const Result& want, const at::Tensor& gate, const at::Tensor& up,
                  const at::Tensor& dh, double tolerance, const std::string& what) {
  // dgate's terms: 1 + g (1 - sigmoid) nearly cancels where g is near -1.28.
  const auto terms = [&](const at::Tensor& t) { return t.to(at::kDouble).abs(); };
  expect_within_terms(got.out, want.out, terms(gate.to(at::kDouble) * up.to(at::kDouble)), tolerance, what + " out");
  expect_within_terms(got.dgate, want.dgate,
                      terms(dh.to(at::kDouble) * up.to(at::kDouble) * (1.0 + gate.to(at::kDouble).abs())), tolerance,
                      what + " dgate");
  expect_within_terms(got.dup, want.dup, terms(dh.to(at::kDouble) * gate.to(at::kDouble)), tolerance, what + " dup");
}

// The kernel computes ATen's formulas at the capability ATen picked. fp32: within 1e-6 of the
// terms, and bitwise wherever ATen's vector loop computed (counted; ATen's scalar tail rounds exp
// its own way). bf16: rounded once from fp32, so within half a bf16 unit (2^-9, and 2^-8 of the
// terms for the fp32 composition's own rounding) of the fp32 composition on the same values, and
// closer to it than the bf16 composition (which rounds after every op).
TEST(SwiGLU, MatchesSiluTimesUp) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor gate = sample(1, dtype), up = sample(2, dtype), w = sample(3, dtype);
    ASSERT_TRUE(kernels::swiglu_is_fused(gate, up));
    const Result fused = run(kernels::swiglu, gate, up, w), want = run(composed, gate, up, w);
    const std::string what = std::string(c10::toString(dtype)) + " at capability " + kernels::kernel_capability();
    const int64_t n = gate.numel();
    if (dtype == at::kFloat) {
      expect_close(fused, want, gate, up, w, 1e-6, what);
    } else {
      const at::Tensor g = gate.to(at::kFloat), u = up.to(at::kFloat), dh = w.to(at::kFloat);
      const Result fp32 = run(composed, g, u, dh);
      expect_close(fused, fp32, g, u, dh, std::ldexp(1.0, -8), what + " against fp32");
      // Closer to fp32 than the bf16 composition is, in each result's largest error.
      expect_no_farther_from_fp32("out", fused.out, want.out, fp32.out);
      expect_no_farther_from_fp32("dgate", fused.dgate, want.dgate, fp32.dgate);
      expect_no_farther_from_fp32("dup", fused.dup, want.dup, fp32.dup);
    }
    std::cout << what << ", bitwise equal to ATen's composition: out " << (fused.out == want.out).sum().item<int64_t>()
              << "/" << n << ", dgate " << (fused.dgate == want.dgate).sum().item<int64_t>() << "/" << n << ", dup "
              << (fused.dup == want.dup).sum().item<int64_t>() << "/" << n << "\n";
  }
}

// Each capability's loops this CPU can run, called directly, against the composition at ATen's
// capability: within 1e-6 of the terms (their exp rounds its own way: std::exp per lane by
// default, SLEEF's vectors for AVX2 and AVX512).
TEST(SwiGLU, EveryCapabilityThisCpuRunsAgrees) {
  const at::Tensor gate = sample(4), up = sample(5), dh = sample(6);
  const Result want = run(composed, gate, up, dh);
  for (const kernels::Loops& loops : kernels::runnable_loops()) {
    std::cout << "capability " << loops.capability << "\n";
    Result got{at::empty_like(gate), at::empty_like(gate), at::empty_like(gate)};
    loops.swiglu_forward(gate, up, got.out);
    loops.swiglu_backward(dh, gate, up, got.dgate, got.dup);
    expect_close(got, want, gate, up, dh, 1e-6, loops.capability);
  }
}

TEST(SwiGLU, ThreadCountsDoNotChangeABit) {
  const at::Tensor gate = sample(10), up = sample(11), w = sample(12);
  const Result one = [&] {
    CpuThreadsGuard guard(1);
    return run(kernels::swiglu, gate, up, w);
  }();
  for (int threads : {2, 3}) {
    CpuThreadsGuard guard(threads);
    expect_bitwise(run(kernels::swiglu, gate, up, w), one, std::to_string(threads) + " threads");
  }
}

// The backward is not differentiable: asking for a second derivative is an error, not a silently
// lost term.
TEST(SwiGLU, DoubleBackwardIsRefused) {
  const at::Tensor gate = sample(16).requires_grad_(true), up = sample(17).requires_grad_(true);
  const at::Tensor out = kernels::swiglu(gate, up).sum();
  expect_error([&] { torch::autograd::grad({out}, {gate}, {}, /*retain_graph=*/true, /*create_graph=*/true); },
               "no double backward");
}

// Strided inputs are made contiguous; other dtypes and broadcasting take the composition itself.
TEST(SwiGLU, OtherInputsTakeTheComposition) {
  const at::Tensor gate = sample(13), up = sample(14), w = sample(15);
  expect_close(run(kernels::swiglu, gate.t(), up.t(), w.t()), run(composed, gate.t(), up.t(), w.t()), gate.t(), up.t(),
               w.t(), 1e-6, "transposed");
  for (const auto& [g, u] :
       {std::pair{gate.to(at::kDouble), up.to(at::kDouble)}, std::pair{gate, up.narrow(0, 0, 1)}}) {
    EXPECT_FALSE(kernels::swiglu_is_fused(g, u));
    EXPECT_TRUE(at::equal(kernels::swiglu(g, u), composed(g, u)));
  }
}

}  // namespace
}  // namespace hp::test
