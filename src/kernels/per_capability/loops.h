// The kernels' loops, compiled once per CPU capability (see cmake/HpLayers.cmake's hp_layer): each
// copy lives in hp::kernels::<DEFAULT|AVX2|AVX512>, as ATen's kernels do in at::vec. Every tensor
// passed is contiguous; its dtype is fp32 or bf16 as each says. The loops read shapes through
// numel() only: Tensor::size() and sizes() call inline virtual c10 functions, which a copy would
// compile with its -m flags and export (ctest capability_symbols_* checks).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#define HP_DECLARE_LOOPS(cap)                                                                                         \
  namespace hp::kernels::cap {                                                                                        \
  /* out = silu(gate) * up; one shape and dtype. */                                                                   \
  void swiglu_forward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& out);                           \
  /* dgate = grad * up * silu'(gate), dup = grad * silu(gate). */                                                     \
  void swiglu_backward(const at::Tensor& grad, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& dgate, \
                       const at::Tensor& dup);                                                                        \
  /* x [rows, d] and weight [d] of one dtype: out = x * rstd * weight, rstd [rows] fp32. */                           \
  void rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out,             \
                        const at::Tensor& rstd);                                                                      \
  /* dx [rows, d] and dweight [d] from the output's gradient. */                                                      \
  void rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,                       \
                         const at::Tensor& rstd, const at::Tensor& dx, const at::Tensor& dweight);                    \
  /* scores [n, rows, keys] (fp32 or bf16) -> probs (fp32 or bf16, same shape): exp(scores * scale - lse) over */     \
  /* each row's first visible[row] (int64 [rows]) keys, 0 past them; lse (fp32 [n, rows]) computed first if */        \
  /* compute_lse. */                                                                                                  \
  void softmax_forward(const at::Tensor& scores, const at::Tensor& visible, double scale, bool compute_lse,           \
                       const at::Tensor& lse, const at::Tensor& probs);                                               \
  /* out (fp32, may be dprobs itself, or bf16) = probs * (dprobs - row) * scale; probs and dprobs fp32 */             \
  /* [n, rows, keys], row fp32 [n, rows]. */                                                                          \
  void softmax_backward(const at::Tensor& probs, const at::Tensor& row, double scale, const at::Tensor& dprobs,       \
                        const at::Tensor& out);                                                                       \
  /* x and out [batch, seq, heads, d] (fp32 or bf16), cos and sin fp32 [seq, d]: out = x * cos + cat(-x_hi, x_lo) */  \
  /* * sin, or its transpose (the backward). */                                                                       \
  void rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t seq, int64_t heads,            \
            bool transpose, const at::Tensor& out);                                                                   \
  /* logits [rows, vocab] (fp32 or bf16), targets int64 [rows] in [0, vocab) or ignore_index: lse (fp32 [rows]) */    \
  /* and losses (fp32 [rows]) = lse - logits[target], 0 where the target is ignored. */                               \
  void cross_entropy_forward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,               \
                             const at::Tensor& lse, const at::Tensor& losses);                                        \
  /* dlogits (the logits' dtype) = (exp(logits - lse) - onehot(target)) * scale, 0 on ignored rows. */                \
  void cross_entropy_backward(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index,              \
                              const at::Tensor& lse, double scale, const at::Tensor& dlogits);                        \
  }

HP_DECLARE_LOOPS(DEFAULT)
HP_DECLARE_LOOPS(AVX2)
HP_DECLARE_LOOPS(AVX512)

namespace hp::kernels {

// One capability's loops, named as ATEN_CPU_CAPABILITY names it.
struct Loops {
  const char* capability;
  decltype(&DEFAULT::swiglu_forward) swiglu_forward;
  decltype(&DEFAULT::swiglu_backward) swiglu_backward;
  decltype(&DEFAULT::rms_norm_forward) rms_norm_forward;
  decltype(&DEFAULT::rms_norm_backward) rms_norm_backward;
  decltype(&DEFAULT::softmax_forward) softmax_forward;
  decltype(&DEFAULT::softmax_backward) softmax_backward;
  decltype(&DEFAULT::rope) rope;
  decltype(&DEFAULT::cross_entropy_forward) cross_entropy_forward;
  decltype(&DEFAULT::cross_entropy_backward) cross_entropy_backward;
};

// The loops of every capability this CPU can run, portable first (src/kernels/loops.cpp).
std::vector<Loops> runnable_loops();

// The loops the kernels run: LibTorch 1.13's rule (ATEN_CPU_CAPABILITY if set, else AVX2 where the
// CPU has it), picked once.
const Loops& loops();

}  // namespace hp::kernels
