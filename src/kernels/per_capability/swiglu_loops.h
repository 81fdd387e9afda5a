// The SwiGLU loops, compiled once per CPU capability (see cmake/HpLayers.cmake's hp_layer):
// each copy lives in hp::kernels::<DEFAULT|AVX2|AVX512>, as ATen's kernels do in at::vec.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#define HP_DECLARE_SWIGLU_LOOPS(cap)                                                                                  \
  namespace hp::kernels::cap {                                                                                        \
  /* out = silu(gate) * up; contiguous, same shape and dtype (float or bfloat16). */                                  \
  void swiglu_forward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out);                           \
  /* dgate = grad * up * silu'(gate), dup = grad * silu(gate). */                                                     \
  void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dgate, \
                       const at::Tensor& dup);                                                                        \
  }

HP_DECLARE_SWIGLU_LOOPS(DEFAULT)
HP_DECLARE_SWIGLU_LOOPS(AVX2)
HP_DECLARE_SWIGLU_LOOPS(AVX512)

namespace hp::kernels {

// One capability's loops, named as ATEN_CPU_CAPABILITY names it.
struct SwigluLoops {
  const char* capability;
  void (*forward)(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out);
  void (*backward)(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dgate,
                   const at::Tensor& dup);
};

// The loops of every capability this CPU can run, portable first (src/kernels/swiglu.cpp).
std::vector<SwigluLoops> runnable_swiglu_loops();

}  // namespace hp::kernels
