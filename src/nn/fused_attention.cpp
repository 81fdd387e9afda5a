// The kernel CoreAttention starts with (default_attention_kernel): the blockwise kernel, and in the
// device build ATen's flash attention for the CUDA problems it computes alike.
//
// Flash attention takes [b, h, s, d] in bf16 or fp16 with one head dim for q, k and v, and masks
// causally by index (query i sees keys 0..i). So it serves a problem only when the positions are
// 0..n-1 on both sides (or the mask is not causal, when positions do not matter) and nothing is
// dropped (our dropout draws by global coordinates; flash's own does not). Everything else (CPU
// tensors, fp32, MLA's unequal head dims, context-parallel shards, dropout) goes to the blockwise
// kernel, which handles every case. Its log-sum-exp is natural-log, [b, h, sq] fp32, like ours,
// so out and lse mix with the blockwise kernel's (merge_attention) and its backward takes ours.
#include <ATen/ATen.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "hp/core/error.h"
#include "hp/nn/attention.h"

#ifdef HP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace hp::nn {
namespace {

#ifdef HP_WITH_CUDA
// Grouped-query attention for a kernel that wants one key/value head per query head: query head i
// uses key/value head i / rep, so each is repeated rep times in place.
at::Tensor per_query_head(const at::Tensor& t, int64_t rep) { return rep == 1 ? t : t.repeat_interleave(rep, 1); }

// The gradient of per_query_head: the sum over each head's rep copies, in fp32.
at::Tensor per_kv_head(const at::Tensor& grad, int64_t rep) {
  const at::Tensor g = grad.to(at::kFloat);
  if (rep == 1) return g;
  return g.view({g.size(0), g.size(1) / rep, rep, g.size(2), g.size(3)}).sum(2);
}

at::Tensor last_dim_dense(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

class FlashAttentionKernel final : public AttentionKernel {
 public:
  explicit FlashAttentionKernel(std::shared_ptr<const AttentionKernel> fallback) : fallback_(std::move(fallback)) {}

  AttentionOutput forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask,
                          double scale) const override {
    if (!serves(q, k, v, mask)) return fallback_->forward(q, k, v, mask, scale);
    const int64_t sq = q.size(2), sk = k.size(2);
    note_attention_work(q.size(0) * q.size(1) * (mask.causal ? sq * (sq + 1) / 2 : sq * sk));
    const int64_t rep = q.size(1) / k.size(1);
    const auto result =
        at::_scaled_dot_product_flash_attention(last_dim_dense(q), last_dim_dense(per_query_head(k, rep)),
                                                last_dim_dense(per_query_head(v, rep)), /*dropout_p=*/0.0, mask.causal,
                                                /*return_debug_mask=*/false, scale);
    return {std::get<0>(result).to(at::kFloat), std::get<1>(result)};
  }

  AttentionGrads backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                          const at::Tensor& lse, const at::Tensor& dout, const AttentionMask& mask,
                          double scale) const override {
    if (!serves(q, k, v, mask)) return fallback_->backward(q, k, v, out, lse, dout, mask, scale);
    const int64_t rep = q.size(1) / k.size(1);
    const at::Tensor none;  // cumulative lengths (dense inputs have none); the random state (no dropout)
    const auto grads = at::_scaled_dot_product_flash_attention_backward(
        last_dim_dense(dout.to(q.scalar_type())), last_dim_dense(q), last_dim_dense(per_query_head(k, rep)),
        last_dim_dense(per_query_head(v, rep)), last_dim_dense(out.to(q.scalar_type())),
        lse.to(at::kFloat).contiguous(), none, none, q.size(2), k.size(2), /*dropout_p=*/0.0, mask.causal, none, none,
        scale);
    return {std::get<0>(grads).to(at::kFloat), per_kv_head(std::get<1>(grads), rep),
            per_kv_head(std::get<2>(grads), rep)};
  }

  // The blockwise kernel adds into the sums itself (ring attention's causal blocks come here).
  void backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                     const at::Tensor& lse, const at::Tensor& dout, const AttentionMask& mask, double scale,
                     const AttentionGrads& sum) const override {
    if (!serves(q, k, v, mask)) return fallback_->backward_into(q, k, v, out, lse, dout, mask, scale, sum);
    AttentionKernel::backward_into(q, k, v, out, lse, dout, mask, scale, sum);
  }

 private:
  static bool serves(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask) {
    const at::ScalarType t = q.scalar_type();
    if (!q.is_cuda() || (t != at::kBFloat16 && t != at::kHalf) || k.scalar_type() != t || v.scalar_type() != t)
      return false;
    if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || k.size(1) == 0 || q.size(1) % k.size(1) != 0) return false;
    if (q.numel() == 0 || k.size(2) == 0) return false;  // flash refuses empty problems
    const int64_t d = q.size(3);
    if (k.size(3) != d || v.size(3) != d || d % 8 != 0 || d > 256) return false;
    if (mask.dropout.p > 0.0) return false;
    if (mask.causal &&
        (q.size(2) != k.size(2) || !positions_in_order(mask.q_positions) || !positions_in_order(mask.k_positions)))
      return false;
    const cudaDeviceProp& gpu = *at::cuda::getDeviceProperties(q.device().index());
    if (gpu.major < 8) return false;  // flash needs Ampere or newer
    // Its backward for head dims above 192 runs on sm80 and sm90 only.
    return d <= 192 || (gpu.major == 8 && gpu.minor == 0) || gpu.major == 9;
  }

  std::shared_ptr<const AttentionKernel> fallback_;
};
#endif

}  // namespace

std::shared_ptr<const AttentionKernel> default_attention_kernel() {
  const char* chosen = std::getenv("HP_ATTENTION_KERNEL");
  const std::string name = chosen == nullptr ? "auto" : chosen;
  HP_CHECK(name == "auto" || name == "blockwise", "HP_ATTENTION_KERNEL is '", name,
           "'; it takes auto (flash attention on GPUs where it applies) or blockwise");
  std::shared_ptr<const AttentionKernel> blockwise = cpu_attention_kernel();
#ifdef HP_WITH_CUDA
  if (name == "auto") return std::make_shared<FlashAttentionKernel>(std::move(blockwise));
#endif
  return blockwise;
}

}  // namespace hp::nn
