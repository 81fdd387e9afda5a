// hp::kernels::masked_softmax and softmax_scores_grad against the ATen composition the blockwise
// attention kernel used (scale, mask with -inf, at::logsumexp, exp): within 1e-6 relative forward
// (the sums' order differs), bitwise for the scores' gradient, in every capability this CPU runs;
// thread counts do not change a bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>

#include "hp/core/cpu_threads.h"
#include "hp/kernels/softmax.h"
#include "kernels/per_capability/loops.h"
#include "test_util.h"

namespace hp::test {
namespace {

constexpr double kScale = 0.17677669529663687;  // 1 / sqrt(32)

// 6 problems of 19 rows of 45 keys (a partial last vector at every width); row r sees visible[r]
// keys: 0 for the first two (a context-parallel shard's rows that precede every key), all for
// the last.
at::Tensor scores_sample(int seed, at::ScalarType dtype = at::kFloat) {
  return (at::randn({6, 19, 45}, at::make_generator<at::CPUGeneratorImpl>(seed)) * 8.0).to(dtype);
}
at::Tensor visible_sample() {
  at::Tensor v = (at::arange(19, at::kLong) * 45).div(18, "floor");
  v[1] = 0;
  return v;
}

// The composition, in fp64 for the reference or in fp32 as the attention kernel computed it.
std::pair<at::Tensor, at::Tensor> composed(const at::Tensor& scores, const at::Tensor& visible,
                                           at::ScalarType dtype = at::kFloat) {
  at::Tensor s = scores.to(dtype).mul(kScale);  // a new tensor: .to may return scores itself
  s.masked_fill_(at::arange(s.size(2), at::kLong).unsqueeze(0) >= visible.unsqueeze(1), -INFINITY);
  const at::Tensor lse = at::logsumexp(s, -1);
  return {s.sub_(lse.masked_fill(at::isinf(lse), 0.0).unsqueeze(-1)).exp_(), lse};
}

// Against the composition in fp64. lse within 1e-6 of its terms' magnitude (|max| + log(keys)),
// and -inf exactly where the composition's is; each probability within 1e-6 of itself times its
// exponent's terms (1 + |s| + |lse|): an exponent rounded in fp32 carries an absolute error in
// proportion to them, which exp turns into a relative one.
void expect_close(const at::Tensor& probs, const at::Tensor& lse, const at::Tensor& scores, const at::Tensor& visible,
                  const std::string& what) {
  const auto [want_probs, want_lse] = composed(scores, visible, at::kDouble);
  const at::Tensor s = (scores.to(at::kDouble) * kScale).abs();
  const at::Tensor exponent = 1.0 + s + want_lse.masked_fill(at::isinf(want_lse), 0.0).abs().unsqueeze(-1);
  const at::Tensor p = probs.to(at::kDouble);
  EXPECT_LE(((p - want_probs).abs() - 1e-6 * want_probs * exponent).max().item<double>(), 0.0) << what << " probs";
  EXPECT_TRUE(at::equal(at::isinf(lse), at::isinf(want_lse))) << what << " lse's infinities";
  const at::Tensor finite = at::isfinite(want_lse);
  const at::Tensor size = s.amax(-1) + std::log(45.0);
  const at::Tensor err = (lse.to(at::kDouble) - want_lse).abs().masked_select(finite);
  EXPECT_LE((err - 1e-6 * size.masked_select(finite)).max().item<double>(), 0.0) << what << " lse";
}

TEST(MaskedSoftmax, MatchesTheCompositionComputingOrGivenTheLse) {
  const at::Tensor visible = visible_sample();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor scores = scores_sample(1, dtype);
    const std::string what = std::string(c10::toString(dtype)) + " at capability " + kernels::kernel_capability();
    at::Tensor lse;
    const at::Tensor probs = kernels::masked_softmax(scores.clone(), visible, kScale, lse);
    expect_close(probs, lse, scores, visible, what);
    // Given another lse (a ring's global one), the probabilities are exp(s - lse) of that one.
    const at::Tensor local = composed(scores, visible).second;
    at::Tensor given = local.masked_fill(at::isinf(local), 0.0) + 0.5;
    const at::Tensor again = kernels::masked_softmax(scores.clone(), visible, kScale, given);
    // Within 1e-5 relative: both exponents (of magnitude up to 10 here) are rounded in fp32.
    EXPECT_TRUE(at::allclose(again, probs * std::exp(-0.5), 1e-5, 0.0)) << what << " given the lse";
    EXPECT_TRUE(at::equal(again.narrow(1, 1, 1), at::zeros_like(again.narrow(1, 1, 1)))) << "a row that sees nothing";
    // In bf16: the fp32 probabilities rounded once, bit for bit.
    at::Tensor lse_again = lse;
    EXPECT_TRUE(at::equal(kernels::masked_softmax(scores.clone(), visible, kScale, lse_again, at::kBFloat16),
                          probs.to(at::kBFloat16)));
  }
}

TEST(MaskedSoftmax, EveryCapabilityThisCpuRunsAgrees) {
  const at::Tensor scores = scores_sample(2), visible = visible_sample();
  for (const kernels::Loops& loops : kernels::runnable_loops()) {
    at::Tensor lse = at::empty({6, 19}), probs = at::empty({6, 19, 45});
    loops.softmax_forward(scores, visible, kScale, /*compute_lse=*/true, lse, probs);
    expect_close(probs, lse, scores, visible, loops.capability);
    // From bf16 scores, to bf16 probabilities.
    const at::Tensor scores16 = scores.to(at::kBFloat16);
    at::Tensor probs16 = at::empty({6, 19, 45}, at::kBFloat16);
    loops.softmax_forward(scores16, visible, kScale, /*compute_lse=*/true, lse, probs16);
    at::Tensor probs32 = at::empty({6, 19, 45});
    loops.softmax_forward(scores16, visible, kScale, /*compute_lse=*/true, lse, probs32);
    expect_close(probs32, lse, scores16, visible, std::string("bf16 ") + loops.capability);
    EXPECT_TRUE(at::equal(probs16, probs32.to(at::kBFloat16))) << "bf16 " << loops.capability << ": rounded once";
  }
}

// The scores' gradient computes the composition's three ops in their order: bitwise; in bf16, the
// fp32 result rounded once.
TEST(MaskedSoftmax, ScoresGradIsTheCompositionBitwise) {
  const at::Tensor probs = composed(scores_sample(3), visible_sample()).first;
  const at::Tensor dprobs = scores_sample(4), row = at::randn({6, 19, 1});
  const at::Tensor want = probs.mul(dprobs.clone().sub_(row)).mul_(kScale);
  for (const kernels::Loops& loops : kernels::runnable_loops()) {
    at::Tensor got = dprobs.clone();
    loops.softmax_backward(probs, row, kScale, got, got);
    EXPECT_TRUE(at::equal(got, want)) << loops.capability;
  }
  EXPECT_TRUE(at::equal(kernels::softmax_scores_grad(probs, dprobs.clone(), row, kScale), want));
  EXPECT_TRUE(at::equal(kernels::softmax_scores_grad(probs, dprobs.clone(), row, kScale, at::kBFloat16),
                        want.to(at::kBFloat16)));
  // fp64 takes the composition.
  const at::Tensor p64 = probs.to(at::kDouble), d64 = dprobs.to(at::kDouble), r64 = row.to(at::kDouble);
  EXPECT_TRUE(at::equal(kernels::softmax_scores_grad(p64, d64.clone(), r64, kScale),
                        p64.mul(d64.clone().sub_(r64)).mul_(kScale)));
}

TEST(MaskedSoftmax, ThreadCountsDoNotChangeABit) {
  const at::Tensor scores = at::randn({64, 128, 128}, at::make_generator<at::CPUGeneratorImpl>(5));
  const at::Tensor visible = at::arange(1, 129, at::kLong);
  const auto run = [&](int threads) {
    CpuThreadsGuard guard(threads);
    at::Tensor lse;
    at::Tensor probs = kernels::masked_softmax(scores.clone(), visible, kScale, lse);
    return std::pair{probs, lse};
  };
  const auto one = run(1);
  for (int threads : {2, 3}) {
    const auto got = run(threads);
    EXPECT_TRUE(at::equal(got.first, one.first)) << threads << " threads";
    EXPECT_TRUE(at::equal(got.second, one.second)) << threads << " threads";
  }
}

TEST(MaskedSoftmax, Fp64AndBadShapes) {
  const at::Tensor scores = scores_sample(6, at::kDouble), visible = visible_sample();
  at::Tensor lse;
  const at::Tensor probs = kernels::masked_softmax(scores.clone(), visible, kScale, lse);
  EXPECT_EQ(probs.scalar_type(), at::kDouble);
  const auto want = composed(scores, visible, at::kDouble);
  EXPECT_TRUE(at::equal(probs, want.first));
  EXPECT_TRUE(at::equal(lse, want.second));
  at::Tensor none;
  expect_error([&] { kernels::masked_softmax(scores, visible.narrow(0, 0, 3), kScale, none); }, "visible int64 [rows]");
  expect_error([&] { kernels::masked_softmax(scores, visible + 1, kScale, none); }, "row 18 sees 46 keys of 45");
  expect_error([&] { kernels::masked_softmax(scores, visible - 1, kScale, none); }, "row 0 sees -1 keys");
  at::Tensor wrong = at::zeros({6, 3}, at::kDouble);
  expect_error([&] { kernels::masked_softmax(scores, visible, kScale, wrong); }, "lse must be [n, rows]");
}

}  // namespace
}  // namespace hp::test
