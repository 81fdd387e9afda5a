// The SwiGLU loops for one CPU capability. Built once per capability with CPU_CAPABILITY set to
// DEFAULT, AVX2 or AVX512 (and the matching -m flags), like ATen's own kernels: at::vec chooses its
// implementation at compile time, so each copy gets the vector width of its capability.
//
// Each element is computed with ATen's own vectorised formulas (silu: x / (1 + exp(-x));
// silu_backward: dy * sigmoid * (1 + x * (1 - sigmoid)), sigmoid = 1 / (1 + exp(-x))) in fp32; bf16
// values are widened once and rounded once.
// The last partial vector is loaded and stored partially but computed like the rest, so an
// element's value does not depend on where a thread's chunk or the tensor ends.
#include "kernels/per_capability/vec_helpers.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <tuple>
#include <utility>

namespace hp::kernels {
inline namespace CPU_CAPABILITY {
namespace {

struct Forward {
  Vec operator()(Vec g, Vec u) const {
    const Vec silu = g / (Vec(1.0f) + g.neg().exp());  // at::silu: x / (1 + exp(-x))
    return silu * u;                                   // * up
  }
};

struct Backward {
  // (dgate, dup) from (grad, gate, up).
  std::pair<Vec, Vec> operator()(Vec dh, Vec g, Vec u) const {
    const Vec one(1.0f);
    const Vec denominator = one + g.neg().exp();
    const Vec sigmoid = one / denominator;
    const Vec dsilu = dh * u;  // mul's backward: grad * up
    // silu_backward: dy * sigmoid * (1 + x * (1 - sigmoid))
    return {dsilu * sigmoid * (one + g * (one - sigmoid)), dh * (g / denominator)};  // mul's: grad * silu
  }
};

// n elements of fp32 arrays: out[i] = f(in[0][i], in[1][i], ...), vector by vector.
template <int kIn, int kOut, typename F>
void float_loop(int64_t n, const float* const (&in)[kIn], float* const (&out)[kOut], const F& f) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += Vec::size()) {
      const int count = static_cast<int>(std::min<int64_t>(Vec::size(), end - i));
      Vec x[kIn];
      for (int k = 0; k < kIn; ++k) x[k] = load<Vec>(in[k] + i, count);
      Vec y[kOut];
      if constexpr (kOut == 1) {
        y[0] = f(x[0], x[1]);
      } else {
        std::tie(y[0], y[1]) = f(x[0], x[1], x[2]);
      }
      for (int k = 0; k < kOut; ++k) y[k].store(out[k] + i, count);
    }
  });
}

// The same over bf16 arrays: each vector of bf16 widened to two of fp32, computed, rounded once.
template <int kIn, int kOut, typename F>
void bfloat16_loop(int64_t n, const c10::BFloat16* const (&in)[kIn], c10::BFloat16* const (&out)[kOut], const F& f) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += BVec::size()) {
      const int count = static_cast<int>(std::min<int64_t>(BVec::size(), end - i));
      Vec lo[kIn], hi[kIn];
      for (int k = 0; k < kIn; ++k)
        std::tie(lo[k], hi[k]) = at::vec::convert_bfloat16_float(load<BVec>(in[k] + i, count));
      Vec y_lo[kOut], y_hi[kOut];
      if constexpr (kOut == 1) {
        y_lo[0] = f(lo[0], lo[1]);
        y_hi[0] = f(hi[0], hi[1]);
      } else {
        std::tie(y_lo[0], y_lo[1]) = f(lo[0], lo[1], lo[2]);
        std::tie(y_hi[0], y_hi[1]) = f(hi[0], hi[1], hi[2]);
      }
      for (int k = 0; k < kOut; ++k) at::vec::convert_float_bfloat16(y_lo[k], y_hi[k]).store(out[k] + i, count);
    }
  });
}

template <typename T>
const T* in_ptr(const at::Tensor& t) {
  return t.data_ptr<T>();
}

}  // namespace

HP_KERNEL_ENTRY void swiglu_forward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out) {
  const int64_t n = gate.numel();
  if (gate.scalar_type() == at::kFloat) {
    float_loop<2, 1>(n, {in_ptr<float>(gate), in_ptr<float>(up)}, {out.data_ptr<float>()}, Forward{});
  } else {
    using B = c10::BFloat16;
    bfloat16_loop<2, 1>(n, {in_ptr<B>(gate), in_ptr<B>(up)}, {out.data_ptr<B>()}, Forward{});
  }
}

HP_KERNEL_ENTRY void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up,
                                     const at::Tensor& dgate, const at::Tensor& dup) {
  const int64_t n = gate.numel();
  if (gate.scalar_type() == at::kFloat) {
    float_loop<3, 2>(n, {in_ptr<float>(grad), in_ptr<float>(gate), in_ptr<float>(up)},
                     {dgate.data_ptr<float>(), dup.data_ptr<float>()}, Backward{});
  } else {
    using B = c10::BFloat16;
    bfloat16_loop<3, 2>(n, {in_ptr<B>(grad), in_ptr<B>(gate), in_ptr<B>(up)}, {dgate.data_ptr<B>(), dup.data_ptr<B>()},
                        Backward{});
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace hp::kernels
