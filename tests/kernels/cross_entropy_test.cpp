// hp::kernels::cross_entropy against the composition it replaces in hp::cross_entropy
// (at::cross_entropy_loss, mean over the targets that are not ignored): the loss and the logits'
// gradient within 1e-6 relative to the size of their terms in fp32, within bf16 rounding of fp32
// in bf16, in every capability this CPU runs; thread counts do not change a bit.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "hp/core/cpu_threads.h"
#include "hp/core/kernel_observer.h"
#include "hp/kernels/cross_entropy.h"
#include "kernels/closeness.h"
#include "kernels/per_capability/loops.h"
#include "test_util.h"

namespace hp::test {
namespace {

constexpr int64_t kVocab = 300;  // a partial last vector at every width
constexpr int64_t kIgnore = -100;

// 37 rows of logits on very different scales.
at::Tensor logits_sample(int seed, int64_t rows = 37, at::ScalarType dtype = at::kFloat) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor scale = at::exp(at::randn({rows, 1}, gen) * 1.5);
  return (at::randn({rows, kVocab}, gen) * scale).to(dtype);
}

// Targets anywhere in the row, the first and the last column among them, and every fifth ignored.
at::Tensor targets_sample(int seed, int64_t rows = 37) {
  at::Tensor t = at::randint(kVocab, {rows}, at::make_generator<at::CPUGeneratorImpl>(seed));
  t[0] = 0;
  t[1] = kVocab - 1;
  t.index_put_({at::arange(rows) % 5 == 4}, kIgnore);
  return t;
}

struct Result {
  at::Tensor loss, dlogits;
};

template <typename F>
Result run(const F& f, const at::Tensor& logits, const at::Tensor& targets, double grad = 0.75) {
  const at::Tensor l = logits.detach().clone().requires_grad_(true);
  const at::Tensor loss = f(l, targets, kIgnore);
  loss.backward(at::full({}, grad, loss.options()));
  return {loss.detach(), l.grad()};
}

// The terms of each result in fp64: the loss averages lse + |x_target| over the counted rows;
// dlogits = (p - onehot) * s, where p = exp(x - lse) carries the rounding of its exponent's terms.
Result terms(const at::Tensor& logits, const at::Tensor& targets, double grad = 0.75) {
  const at::Tensor x = logits.to(at::kDouble).reshape({-1, kVocab}), t = targets.reshape({-1});
  const at::Tensor valid = t.ne(kIgnore), safe = t.clamp_min(0);
  const at::Tensor lse = x.logsumexp(1), target_logit = x.gather(1, safe.unsqueeze(1)).squeeze(1);
  const double count = valid.sum().item<double>();
  const at::Tensor loss = ((lse.abs() + target_logit.abs()) * valid).sum() / count;
  const at::Tensor p = (x - lse.unsqueeze(1)).exp();
  const at::Tensor onehot = at::zeros_like(x).scatter_(1, safe.unsqueeze(1), 1.0);
  const at::Tensor d =
      (p * (1.0 + x.abs() + lse.abs().unsqueeze(1)) + onehot) * std::abs(grad) / count * valid.unsqueeze(1);
  return {loss, d.view(logits.sizes())};
}

void expect_close(const Result& got, const Result& want, const Result& size, double tolerance,
                  const std::string& what) {
  expect_within_terms(got.loss, want.loss, size.loss, tolerance, what + " loss");
  expect_within_terms(got.dlogits, want.dlogits, size.dlogits, tolerance, what + " dlogits");
}

// fp32: within 1e-6 of the terms. bf16: computed in fp32 from the widened logits and rounded once
// (2^-9), so within 2^-8 of the terms of the fp32 composition on the same values (the output's
// gradient, 0.75, is a bf16 value); the gradient no farther from it than the bf16 composition's.
TEST(CrossEntropyKernel, MatchesTheComposition) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor logits = logits_sample(1, 37, dtype), targets = targets_sample(2);
    ASSERT_TRUE(kernels::cross_entropy_is_fused(logits, targets));
    const Result fused = run(kernels::cross_entropy, logits, targets);
    const Result want = run(kernels::cross_entropy_composed, logits, targets);
    const std::string what = std::string(c10::toString(dtype)) + " at capability " + kernels::kernel_capability();
    EXPECT_EQ(fused.loss.scalar_type(), dtype);
    EXPECT_EQ(fused.dlogits.scalar_type(), dtype);
    EXPECT_TRUE(fused.dlogits.index({at::arange(37) % 5 == 4}).eq(0).all().item<bool>()) << "ignored rows";
    if (dtype == at::kFloat) {
      expect_close(fused, want, terms(logits, targets), 1e-6, what);
      continue;
    }
    const at::Tensor x32 = logits.to(at::kFloat);
    const Result fp32 = run(kernels::cross_entropy_composed, x32, targets);
    // Below bf16's smallest normal number a rounding errs by up to half its smallest subnormal
    // (2^-134) whatever the value: the terms get a floor of 2^-126 (2^-134 at this tolerance).
    Result size = terms(x32, targets);
    size.dlogits = size.dlogits.clamp_min(std::ldexp(1.0, -126));
    expect_close(fused, fp32, size, std::ldexp(1.0, -8), what + " against fp32");
    expect_no_farther_from_fp32("dlogits", fused.dlogits, want.dlogits, fp32.dlogits);
  }
}

// Each capability's loops this CPU can run, called directly, against the composition: the
// per-row losses' mean and the gradient within 1e-6 of their terms (fp32).
TEST(CrossEntropyKernel, EveryCapabilityThisCpuRunsAgrees) {
  const at::Tensor logits = logits_sample(3), targets = targets_sample(4);
  const Result want = run(kernels::cross_entropy_composed, logits, targets, 1.0);
  const double count = targets.ne(kIgnore).sum().item<double>();
  for (const kernels::Loops& loops : kernels::runnable_loops()) {
    const at::Tensor lse = at::empty({37}), losses = at::empty({37}), dlogits = at::empty_like(logits);
    loops.cross_entropy_forward(logits, targets, kIgnore, lse, losses);
    loops.cross_entropy_backward(logits, targets, kIgnore, lse, 1.0 / count, dlogits);
    expect_within_terms(lse, logits.logsumexp(1), logits.abs().amax(1) + logits.logsumexp(1).abs(), 1e-6,
                        std::string(loops.capability) + " lse");
    expect_close({losses.sum() / count, dlogits}, want, terms(logits, targets, 1.0), 1e-6, loops.capability);
  }
}

// 370 rows: 54 rows per task, so both loops split over the threads.
TEST(CrossEntropyKernel, ThreadCountsDoNotChangeABit) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const at::Tensor logits = logits_sample(5, 370, dtype), targets = targets_sample(6, 370);
    const Result one = [&] {
      CpuThreadsGuard guard(1);
      return run(kernels::cross_entropy, logits, targets);
    }();
    for (int threads : {2, 3}) {
      CpuThreadsGuard guard(threads);
      const Result got = run(kernels::cross_entropy, logits, targets);
      EXPECT_TRUE(at::equal(got.loss, one.loss)) << threads << " threads";
      EXPECT_TRUE(at::equal(got.dlogits, one.dlogits)) << threads << " threads";
    }
  }
}

// Leading dims of any shape and strided logits; fp64, int32 targets and DTensors take the
// composition.
TEST(CrossEntropyKernel, OtherInputs) {
  const at::Tensor logits = logits_sample(7, 36).view({4, 9, kVocab}).transpose(0, 1);
  const at::Tensor targets = targets_sample(8, 36).view({4, 9}).transpose(0, 1);
  ASSERT_FALSE(logits.is_contiguous());
  ASSERT_TRUE(kernels::cross_entropy_is_fused(logits, targets));
  const Result got = run(kernels::cross_entropy, logits, targets);
  expect_close(got, run(kernels::cross_entropy_composed, logits, targets), terms(logits, targets), 1e-6, "strided 3-d");
  EXPECT_EQ(got.dlogits.sizes(), logits.sizes());
  EXPECT_FALSE(kernels::cross_entropy_is_fused(logits.to(at::kDouble), targets));
  EXPECT_FALSE(kernels::cross_entropy_is_fused(logits, targets.to(at::kInt)));
  EXPECT_FALSE(kernels::cross_entropy_is_fused(logits, targets.reshape({-1})));
  const at::Tensor x64 = logits.to(at::kDouble);
  EXPECT_TRUE(at::equal(kernels::cross_entropy(x64, targets), kernels::cross_entropy_composed(x64, targets)));
}

TEST(CrossEntropyKernel, BadTargetsAreNamed) {
  const at::Tensor logits = logits_sample(9);
  for (const int64_t bad : {kVocab, int64_t{-1}}) {
    at::Tensor targets = targets_sample(10);
    targets[6] = bad;
    expect_error([&] { kernels::cross_entropy(logits, targets); },
                 "target " + std::to_string(bad) + " (row 6) is out of range for 300 classes");
  }
  // Every target ignored: NaN, as the composition gives.
  const at::Tensor ignored = at::full({37}, kIgnore, at::kLong);
  EXPECT_TRUE(std::isnan(kernels::cross_entropy(logits, ignored).item<double>()));
  EXPECT_TRUE(std::isnan(kernels::cross_entropy_composed(logits, ignored).item<double>()));
}

// A dry run's meta logits: the loss and the gradient are meta tensors of the right shapes, and the
// kernels announce their bytes to the observer (the cost model counts them) as a real run's do.
TEST(CrossEntropyKernel, MetaLogitsComputeNothingButAreCounted) {
  struct Seen : KernelObserver {
    std::map<std::string, int64_t> bytes;
    void kernel_ran(const char* name, int64_t b, double) override { bytes[name] += b; }
  };
  for (const bool meta : {true, false}) {
    const auto device = meta ? at::device(at::kMeta) : at::device(at::kCPU);
    const at::Tensor logits = at::zeros({8, 5, kVocab}, device).requires_grad_(true);
    const at::Tensor targets = at::zeros({8, 5}, device.dtype(at::kLong));
    ASSERT_TRUE(kernels::cross_entropy_is_fused(logits, targets));
    Seen seen;
    {
      const KernelObserverGuard observe(&seen);
      const at::Tensor loss = kernels::cross_entropy(logits, targets);
      EXPECT_EQ(loss.is_meta(), meta);
      EXPECT_EQ(loss.dim(), 0);
      loss.backward();
    }
    EXPECT_EQ(logits.grad().is_meta(), meta);
    EXPECT_EQ(logits.grad().sizes(), logits.sizes());
    const int64_t bytes = 8 * 5 * kVocab * 4;
    EXPECT_EQ(seen.bytes,
              (std::map<std::string, int64_t>{{"cross_entropy_forward", bytes}, {"cross_entropy_backward", 2 * bytes}}))
        << (meta ? "meta" : "cpu");
  }
}

// ignore_index may be any value, a class among them: that class's targets are not counted.
TEST(CrossEntropyKernel, AnyIgnoreIndex) {
  const at::Tensor logits = logits_sample(13);
  at::Tensor targets = targets_sample(14).clamp_min(0);
  targets.index_put_({at::arange(37) % 3 == 0}, 7);
  for (const int64_t ignore : {int64_t{7}, int64_t{0}, int64_t{-1}}) {
    const at::Tensor fused = kernels::cross_entropy(logits, targets, ignore);
    const at::Tensor composed = kernels::cross_entropy_composed(logits, targets, ignore);
    EXPECT_NEAR(fused.item<double>(), composed.item<double>(), 1e-6 * std::abs(composed.item<double>())) << ignore;
  }
}

TEST(CrossEntropyKernel, DoubleBackwardIsRefused) {
  const at::Tensor logits = logits_sample(11).requires_grad_(true);
  const at::Tensor loss = kernels::cross_entropy(logits, targets_sample(12));
  expect_error([&] { torch::autograd::grad({loss}, {logits}, {}, /*retain_graph=*/true, /*create_graph=*/true); },
               "no double backward");
}

}  // namespace
}  // namespace hp::test
