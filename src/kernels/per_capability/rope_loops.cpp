// The rotary embedding's loops for one capability (see swiglu_loops.cpp for how the copies are
// built). Each head's row of d values, in halves lo = x[:d/2] and hi = x[d/2:], with the fp32
// table rows c and s of its token's position (as the composition x * cos + cat(-hi, lo) * sin):
//   out_lo = lo * c_lo - hi * s_lo,            out_hi = hi * c_hi + lo * s_hi;
// backward, its transpose:
//   dx_lo = g_lo * c_lo + g_hi * s_hi,         dx_hi = g_hi * c_hi - g_lo * s_lo.
// In fp32; bf16 values widened once and each result rounded once. Elementwise, so no result
// depends on the thread count.
#include "kernels/per_capability/vec_helpers.h"

#include <ATen/core/Tensor.h>

namespace hp::kernels {
inline namespace CPU_CAPABILITY {
namespace {

template <typename T>
void rotate(const at::Tensor& x_t, const at::Tensor& cos_t, const at::Tensor& sin_t, int64_t seq, int64_t heads,
            bool transpose, const at::Tensor& out_t) {
  const int64_t d = cos_t.numel() / seq, half = d / 2, rows = x_t.numel() / d;
  const T* x = x_t.data_ptr<T>();
  const float* cos = cos_t.data_ptr<float>();
  const float* sin = sin_t.data_ptr<float>();
  T* out = out_t.data_ptr<T>();
  at::parallel_for(0, rows, rows_per_task(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* o = out + r * d;
      const float* c = cos + ((r / heads) % seq) * d;
      const float* s = sin + ((r / heads) % seq) * d;
      for (int64_t j = 0; j < half; j += Vec2::kSize) {
        const int count = lanes_at(j, half);
        const Vec2 lo = load2(xr + j, count), hi = load2(xr + half + j, count);
        const Vec2 c_lo = load2(c + j, count), c_hi = load2(c + half + j, count);
        const Vec2 s_lo = load2(s + j, count), s_hi = load2(s + half + j, count);
        if (transpose) {
          store2(lo * c_lo + hi * s_hi, o + j, count);
          store2(hi * c_hi - lo * s_lo, o + half + j, count);
        } else {
          store2(lo * c_lo - hi * s_lo, o + j, count);
          store2(hi * c_hi + lo * s_hi, o + half + j, count);
        }
      }
    }
  });
}

}  // namespace

HP_KERNEL_ENTRY void rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t seq, int64_t heads,
                          bool transpose, const at::Tensor& out) {
  if (x.scalar_type() == at::kFloat)
    rotate<float>(x, cos, sin, seq, heads, transpose, out);
  else
    rotate<c10::BFloat16>(x, cos, sin, seq, heads, transpose, out);
}

}  // namespace CPU_CAPABILITY
}  // namespace hp::kernels
