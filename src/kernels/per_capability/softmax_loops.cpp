// The attention softmax's loops for one capability (see swiglu_loops.cpp for how the copies are
// built). Row by row in fp32, as the composition the blockwise attention kernel used computes it:
//   s = scores * scale (rounded to fp32),
//   lse = log(sum(exp(s - max))) + max over the row's visible keys (-inf where it sees none),
//   probs = exp(s - lse) over the visible keys (exp(s) where lse is infinite), 0 past them;
// backward: dscores = probs * (dprobs - row) * scale. Each result is stored in fp32 or rounded
// once to bf16 (what a cast of the fp32 result gives). A row is computed in one order
// whatever the thread count.
#include "kernels/per_capability/vec_helpers.h"

#include <ATen/core/Tensor.h>

#include <cmath>
#include <limits>

// Shapes come from numel(): Tensor::size() would compile an inline c10 function here (see loops.h).

namespace hp::kernels {
inline namespace CPU_CAPABILITY {
namespace {

template <typename T, typename Out>
void forward(const at::Tensor& scores_t, const at::Tensor& visible_t, double scale, bool compute_lse,
             const at::Tensor& lse_t, const at::Tensor& probs_t) {
  const int64_t rows = visible_t.numel(), keys = scores_t.numel() / lse_t.numel();
  const T* scores = scores_t.data_ptr<T>();
  const int64_t* visible = visible_t.data_ptr<int64_t>();
  float* lse = lse_t.data_ptr<float>();
  Out* probs = probs_t.data_ptr<Out>();
  const Vec2 scale_v = Vec2::all(static_cast<float>(scale));
  const float infinity = std::numeric_limits<float>::infinity();
  at::parallel_for(0, lse_t.numel(), rows_per_task(keys), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* s = scores + i * keys;
      Out* p = probs + i * keys;
      const int64_t seen = visible[i % rows];
      if (compute_lse) {
        if (seen == 0) {
          lse[i] = -infinity;
        } else {
          // Over the row's visible keys only (those past them are -inf).
          float max = row_max(s, seen, scale_v);
          if (std::isinf(max)) max = 0.0f;
          lse[i] = std::log(row_sum_exp(s, seen, scale_v, max)) + max;
        }
      }
      const Vec2 shift = Vec2::all(std::isinf(lse[i]) ? 0.0f : lse[i]);
      for (int64_t j = 0; j < seen; j += Vec2::kSize) {
        const int count = lanes_at(j, seen);
        store2((load2(s + j, count) * scale_v - shift).exp(), p + j, count);
      }
      std::fill(p + seen, p + keys, Out(0.0f));
    }
  });
}

template <typename Out>
void backward(const at::Tensor& probs_t, const at::Tensor& row_t, double scale, const at::Tensor& dprobs_t,
              const at::Tensor& out_t) {
  const int64_t keys = probs_t.numel() / row_t.numel();
  const float* probs = probs_t.data_ptr<float>();
  const float* row = row_t.data_ptr<float>();
  const float* dprobs = dprobs_t.data_ptr<float>();
  Out* out = out_t.data_ptr<Out>();
  const Vec2 scale_v = Vec2::all(static_cast<float>(scale));
  at::parallel_for(0, row_t.numel(), rows_per_task(keys), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Vec2 r = Vec2::all(row[i]);
      for (int64_t j = 0; j < keys; j += Vec2::kSize) {
        const int count = lanes_at(j, keys);
        const int64_t offset = i * keys + j;
        store2(load2(probs + offset, count) * (load2(dprobs + offset, count) - r) * scale_v, out + offset, count);
      }
    }
  });
}

// Calls f with a value of each of the dtypes of a and b (fp32 or bf16): f(A{}, B{}).
template <typename F>
void by_dtypes(const at::Tensor& a, const at::Tensor& b, const F& f) {
  const bool a32 = a.scalar_type() == at::kFloat, b32 = b.scalar_type() == at::kFloat;
  using B16 = c10::BFloat16;
  if (a32 && b32) f(float{}, float{});
  if (a32 && !b32) f(float{}, B16{});
  if (!a32 && b32) f(B16{}, float{});
  if (!a32 && !b32) f(B16{}, B16{});
}

}  // namespace

HP_KERNEL_ENTRY void softmax_forward(const at::Tensor& scores, const at::Tensor& visible, double scale,
                                     bool compute_lse, const at::Tensor& lse, const at::Tensor& probs) {
  by_dtypes(scores, probs, [&](auto in, auto out) {
    forward<decltype(in), decltype(out)>(scores, visible, scale, compute_lse, lse, probs);
  });
}

HP_KERNEL_ENTRY void softmax_backward(const at::Tensor& probs, const at::Tensor& row, double scale,
                                      const at::Tensor& dprobs, const at::Tensor& out) {
  if (out.scalar_type() == at::kFloat)
    backward<float>(probs, row, scale, dprobs, out);
  else
    backward<c10::BFloat16>(probs, row, scale, dprobs, out);
}

}  // namespace CPU_CAPABILITY
}  // namespace hp::kernels
