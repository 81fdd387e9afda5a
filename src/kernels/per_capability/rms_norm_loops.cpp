// The RMSNorm loops for one capability (see swiglu_loops.cpp for how the copies are built).
//
// Each row in fp32: rstd = 1 / sqrt(sum(x^2) / d + eps), normed = x * rstd, out = normed * weight,
// as the composition x * rsqrt(x.pow(2).mean(-1) + eps) (in fp32) * weight computes them. bf16:
// normed is rounded to bf16 before the product with the weight, as the composition rounds it, and
// out is rounded once. The backward keeps fp32 throughout and rounds each result once:
//   dnormed = grad * weight,  dx = dnormed * rstd - x * rstd^3 * sum(dnormed * x) / d,
//   dweight = sum over rows of grad * normed (summed in row order for each column).
// A row's sums run in one order whatever the thread count, and dweight's columns are summed row
// by row, so no result depends on the threads.
#include "kernels/per_capability/vec_helpers.h"

#include <ATen/core/Tensor.h>

#include <cmath>

// Shapes come from numel(): Tensor::size() would compile an inline c10 function here (see loops.h).

namespace hp::kernels {
inline namespace CPU_CAPABILITY {
namespace {

// normed = x * rstd, as a tensor of T holds it (bf16: rounded).
template <typename T>
Vec2 normed(const Vec2& x, const Vec2& rstd) {
  const Vec2 n = x * rstd;
  if constexpr (std::is_same_v<T, float>) {
    return n;
  } else {
    return round_to_bfloat16(n);
  }
}

template <typename T>
void forward(const at::Tensor& x_t, const at::Tensor& w_t, double eps, const at::Tensor& out_t,
             const at::Tensor& rstd_t) {
  const int64_t d = w_t.numel(), rows = x_t.numel() / d;
  const T* x = x_t.data_ptr<T>();
  const T* w = w_t.data_ptr<T>();
  T* out = out_t.data_ptr<T>();
  float* rstd = rstd_t.data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, rows_per_task(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      const float mean_square = row_sum(d,
                                        [&](int64_t j, int count) {
                                          const Vec2 v = load2(xr + j, count);
                                          return v * v;
                                        }) /
                                static_cast<float>(d);
      rstd[r] = 1.0f / std::sqrt(mean_square + eps_f);
      const Vec2 rs = Vec2::all(rstd[r]);
      for (int64_t j = 0; j < d; j += Vec2::kSize) {
        const int count = lanes_at(j, d);
        store2(normed<T>(load2(xr + j, count), rs) * load2(w + j, count), out + r * d + j, count);
      }
    }
  });
}

template <typename T>
void backward(const at::Tensor& grad_t, const at::Tensor& x_t, const at::Tensor& w_t, const at::Tensor& rstd_t,
              const at::Tensor& dx_t, const at::Tensor& dw_t) {
  const int64_t d = w_t.numel(), rows = x_t.numel() / d;
  const T* grad = grad_t.data_ptr<T>();
  const T* x = x_t.data_ptr<T>();
  const T* w = w_t.data_ptr<T>();
  const float* rstd = rstd_t.data_ptr<float>();
  T* dx = dx_t.data_ptr<T>();
  T* dw = dw_t.data_ptr<T>();
  at::parallel_for(0, rows, rows_per_task(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gr = grad + r * d;
      const T* xr = x + r * d;
      const float dot = row_sum(
          d, [&](int64_t j, int count) { return load2(gr + j, count) * load2(w + j, count) * load2(xr + j, count); });
      const Vec2 rs = Vec2::all(rstd[r]);
      const Vec2 correction = Vec2::all(rstd[r] * rstd[r] * rstd[r] * dot / static_cast<float>(d));
      for (int64_t j = 0; j < d; j += Vec2::kSize) {
        const int count = lanes_at(j, d);
        const Vec2 dnormed = load2(gr + j, count) * load2(w + j, count);
        store2(dnormed * rs - load2(xr + j, count) * correction, dx + r * d + j, count);
      }
    }
  });
  // dweight by columns, each summed over the rows in order.
  const int64_t steps = (d + Vec2::kSize - 1) / Vec2::kSize;
  at::parallel_for(0, steps, 1, [&](int64_t begin, int64_t end) {
    for (int64_t step = begin; step < end; ++step) {
      const int64_t j = step * Vec2::kSize;
      const int count = lanes_at(j, d);
      Vec2 acc = Vec2::all(0.0f);
      for (int64_t r = 0; r < rows; ++r)
        acc = acc + load2(grad + r * d + j, count) * normed<T>(load2(x + r * d + j, count), Vec2::all(rstd[r]));
      store2(acc, dw + j, count);
    }
  });
}

}  // namespace

HP_KERNEL_ENTRY void rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out,
                                      const at::Tensor& rstd) {
  if (x.scalar_type() == at::kFloat)
    forward<float>(x, weight, eps, out, rstd);
  else
    forward<c10::BFloat16>(x, weight, eps, out, rstd);
}

HP_KERNEL_ENTRY void rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                       const at::Tensor& rstd, const at::Tensor& dx, const at::Tensor& dweight) {
  if (x.scalar_type() == at::kFloat)
    backward<float>(grad, x, weight, rstd, dx, dweight);
  else
    backward<c10::BFloat16>(grad, x, weight, rstd, dx, dweight);
}

}  // namespace CPU_CAPABILITY
}  // namespace hp::kernels
