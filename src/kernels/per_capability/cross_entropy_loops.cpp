// The cross-entropy loops for one capability (see swiglu_loops.cpp for how the copies are built).
//
// Each row of logits in fp32 (bf16 widened once): max, then sum(exp(x - max)) in one order,
// lse = max + log(sum), loss = lse - x[target]; 0 where the target is ignored. The backward writes
// exp(x - lse) * scale - (j == target) * scale, the product of log_softmax's and nll_loss's
// backwards as ATen composes them, computed in fp32 and rounded once; rows with an ignored target
// get zeros. No result depends on the thread count: a row's sums run in one order.
#include "kernels/per_capability/vec_helpers.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>

// Shapes come from numel(): Tensor::size() would compile an inline c10 function here (see loops.h).

namespace hp::kernels {
inline namespace CPU_CAPABILITY {
namespace {

// The row's log-sum-exp: its largest value, then the sum of exponentials shifted by it; one order.
template <typename T>
float row_log_sum_exp(const T* row, int64_t vocab) {
  const Vec2 one = Vec2::all(1.0f);
  const float max = row_max(row, vocab, one);
  return max + std::log(row_sum_exp(row, vocab, one, max));
}

template <typename T>
void forward(const at::Tensor& logits_t, const at::Tensor& targets_t, int64_t ignore_index, const at::Tensor& lse_t,
             const at::Tensor& losses_t) {
  const int64_t rows = targets_t.numel(), vocab = logits_t.numel() / rows;
  const T* logits = logits_t.data_ptr<T>();
  const int64_t* targets = targets_t.data_ptr<int64_t>();
  float* lse = lse_t.data_ptr<float>();
  float* losses = losses_t.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * vocab;
      lse[r] = row_log_sum_exp(row, vocab);
      losses[r] = targets[r] == ignore_index ? 0.0f : lse[r] - static_cast<float>(row[targets[r]]);
    }
  });
}

template <typename T>
void backward(const at::Tensor& logits_t, const at::Tensor& targets_t, int64_t ignore_index, const at::Tensor& lse_t,
              double scale, const at::Tensor& dlogits_t) {
  const int64_t rows = targets_t.numel(), vocab = logits_t.numel() / rows;
  const T* logits = logits_t.data_ptr<T>();
  const int64_t* targets = targets_t.data_ptr<int64_t>();
  const float* lse = lse_t.data_ptr<float>();
  T* dlogits = dlogits_t.data_ptr<T>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, rows, rows_per_task(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * vocab;
      T* out = dlogits + r * vocab;
      const int64_t target = targets[r];
      if (target == ignore_index) {
        std::fill(out, out + vocab, T(0.0f));
        continue;
      }
      const Vec2 shift = Vec2::all(lse[r]), sv = Vec2::all(s);
      for (int64_t j = 0; j < vocab; j += Vec2::kSize) {
        const int count = lanes_at(j, vocab);
        Vec2 d = (load2(row + j, count) - shift).exp() * sv;
        if (target >= j && target < j + count) {  // the target's lane: minus scale, before rounding
          __at_align__ float lanes[Vec2::kSize];
          d.store(lanes);
          lanes[target - j] -= s;
          d = load2(lanes, Vec2::kSize);
        }
        store2(d, out + j, count);
      }
    }
  });
}

}  // namespace

HP_KERNEL_ENTRY void cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                                           const at::Tensor& lse, const at::Tensor& losses) {
  if (logits.scalar_type() == at::kFloat)
    forward<float>(logits, targets, ignore_index, lse, losses);
  else
    forward<c10::BFloat16>(logits, targets, ignore_index, lse, losses);
}

HP_KERNEL_ENTRY void cross_entropy_backward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,
                                            const at::Tensor& lse, double scale, const at::Tensor& dlogits) {
  if (logits.scalar_type() == at::kFloat)
    backward<float>(logits, targets, ignore_index, lse, scale, dlogits);
  else
    backward<c10::BFloat16>(logits, targets, ignore_index, lse, scale, dlogits);
}

}  // namespace CPU_CAPABILITY
}  // namespace hp::kernels
