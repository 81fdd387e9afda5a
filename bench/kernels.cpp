// bench/kernels: hp's fused CPU kernels against the ATen compositions they replace, forward and
// backward, on the main job's activations (16 x 128 tokens), fp32 and bf16, alternating in one run;
// median of the rounds, at the process's thread count.
//   - SwiGLU (hp::kernels::swiglu) against at::silu(gate) * up, hidden 768;
//   - RMSNorm (hp::kernels::rms_norm) against kernels::rms_norm_composed, dim 256;
//   - RoPE (hp::kernels::rope) against kernels::rope_composed, 8 heads of 32;
//   - the attention softmax (hp::kernels::masked_softmax, causal) against scale, mask, logsumexp
//     and exp, on 16 rows x 8 heads of 128 x 128 scores (forward only: its backward is one
//     elementwise pass either way);
//   - cross-entropy (hp::kernels::cross_entropy) against at::cross_entropy_loss, on the main job's
//     logits (vocab 256) and on a vocabulary of 32,000 (512 tokens), mean over the tokens.
//
//   build/bin/bench_kernels [--quick]
#include <ATen/ATen.h>

#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "bench/timing.h"
#include "hp/core/cpu_threads.h"
#include "hp/kernels/cross_entropy.h"
#include "hp/kernels/rms_norm.h"
#include "hp/kernels/rope.h"
#include "hp/kernels/softmax.h"
#include "hp/kernels/swiglu.h"

namespace {

using Case = std::function<void()>;

// The median seconds of `fused` and `composed`, alternating, and their ratio.
void compare(const std::string& name, const std::string& dtype, int rounds, const Case& fused, const Case& composed) {
  std::vector<double> f, c;
  for (int i = 0; i < rounds; ++i) {
    f.push_back(hp::bench::seconds(fused));
    c.push_back(hp::bench::seconds(composed));
  }
  const double mf = hp::bench::median(f), mc = hp::bench::median(c);
  std::cout << std::fixed << std::setprecision(3) << "  " << name << " " << dtype << ": fused " << 1e3 * mf
            << " ms, composed " << 1e3 * mc << " ms, ratio " << mf / mc << "\n";
}

// One forward and backward of f(a, b) on fresh leaves.
template <typename F>
Case step(F f, const at::Tensor& a, const at::Tensor& b, const at::Tensor& grad) {
  return [=] {
    const at::Tensor x = a.detach().requires_grad_(true), y = b.detach().requires_grad_(true);
    f(x, y).backward(grad);
  };
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int rounds = quick ? 3 : 30;
  std::cout << "bench_kernels: forward + backward, " << hp::cpu_threads() << " threads, capability "
            << hp::kernels::kernel_capability() << ", median of " << rounds << " rounds\n";
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const std::string name = dtype == at::kFloat ? "fp32" : "bf16";
    const auto sample = [&](std::vector<int64_t> shape) { return at::randn(shape, gen).to(dtype); };
    {
      const at::Tensor gate = sample({2048, 768}), up = sample({2048, 768}), grad = sample({2048, 768});
      compare("swiglu [2048, 768]", name, rounds, step(hp::kernels::swiglu, gate, up, grad),
              step([](const at::Tensor& g, const at::Tensor& u) { return at::silu(g) * u; }, gate, up, grad));
    }
    {
      const at::Tensor x = sample({2048, 256}), w = sample({256}), grad = sample({2048, 256});
      const auto with = [](auto f) { return [f](const at::Tensor& a, const at::Tensor& b) { return f(a, b, 1e-6); }; };
      compare("rms_norm [2048, 256]", name, rounds, step(with(hp::kernels::rms_norm), x, w, grad),
              step(with(hp::kernels::rms_norm_composed), x, w, grad));
    }
    {
      const at::Tensor x = sample({16, 128, 8, 32}), grad = sample({16, 128, 8, 32});
      const at::Tensor angles =
          at::outer(at::arange(128, at::kDouble), at::pow(10000.0, -at::arange(0, 32, 2, at::kDouble) / 32))
              .repeat({1, 2});
      const at::Tensor cos = angles.cos().to(at::kFloat), sin = angles.sin().to(at::kFloat);
      const auto with = [&](auto f) {
        return [f, cos, sin](const at::Tensor& a, const at::Tensor&) { return f(a, cos, sin); };
      };
      compare("rope [16, 128, 8, 32]", name, rounds, step(with(hp::kernels::rope), x, x, grad),
              step(with(hp::kernels::rope_composed), x, x, grad));
    }
    {
      const at::Tensor scores = sample({128, 128, 128}), visible = at::arange(1, 129, at::kLong);
      const double scale = 0.17677669529663687;
      compare(
          "attention softmax [128, 128, 128]", name, rounds,
          [&] {
            at::Tensor lse;
            hp::kernels::masked_softmax(scores.clone(), visible, scale, lse);  // as attention: a fresh product
          },
          [&] {
            at::Tensor s = scores.to(at::kFloat, false, /*copy=*/true).mul_(scale);
            s.masked_fill_(at::arange(128, at::kLong).unsqueeze(0) >= visible.unsqueeze(1), -INFINITY);
            const at::Tensor lse = at::logsumexp(s, -1);
            s.sub_(lse.masked_fill(at::isinf(lse), 0.0).unsqueeze(-1)).exp_();
          });
    }
    for (const auto& [rows, vocab] : {std::pair<int64_t, int64_t>{2048, 256}, {512, 32000}}) {
      const at::Tensor logits = sample({rows, vocab}), targets = at::randint(vocab, {rows}, gen);
      const auto with = [&](auto f) {
        return [f, logits, targets] { f(logits.detach().requires_grad_(true), targets, -100).backward(); };
      };
      compare("cross_entropy [" + std::to_string(rows) + ", " + std::to_string(vocab) + "]", name, rounds,
              with(hp::kernels::cross_entropy), with(hp::kernels::cross_entropy_composed));
    }
  }
  return 0;
}
