#include "hp/kernels/cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/core/error.h"
#include "hp/core/kernel_observer.h"
#include "kernels/fusable.h"
#include "kernels/per_capability/loops.h"

namespace hp::kernels {
namespace {

// The number of targets that are not ignore_index; a target out of [0, vocab) is an error (the
// loops index the row by it).
int64_t counted_targets(const at::Tensor& targets, int64_t vocab, int64_t ignore_index) {
  const int64_t* t = targets.data_ptr<int64_t>();
  int64_t count = 0;
  for (int64_t r = 0; r < targets.numel(); ++r) {
    if (t[r] == ignore_index) continue;
    HP_CHECK(t[r] >= 0 && t[r] < vocab, "cross_entropy: target ", t[r], " (row ", r, ") is out of range for ", vocab,
             " classes, and is not ignore_index (", ignore_index, ")");
    ++count;
  }
  return count;
}

struct FusedCrossEntropy : torch::autograd::Function<FusedCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t ignore_index) {
    const int64_t vocab = logits.size(-1);
    const at::Tensor rows = logits.contiguous().view({-1, vocab}), flat = targets.contiguous().view({-1});
    at::Tensor lse = at::empty({rows.size(0)}, rows.options().dtype(at::kFloat));
    at::Tensor loss = at::empty({}, logits.options()), losses = at::empty_like(lse);
    // A dry run keeps the kernel's memory and bytes, not its values.
    const int64_t count = rows.is_meta() ? 0 : counted_targets(flat, vocab, ignore_index);
    run_kernel("cross_entropy_forward", rows.nbytes(), [&] {
      if (rows.is_meta()) return;
      loops().cross_entropy_forward(rows, flat, ignore_index, lse, losses);
      const float* l = losses.data_ptr<float>();
      double total = 0.0;
      for (int64_t r = 0; r < losses.numel(); ++r) total += l[r];  // row order
      loss.fill_(total / static_cast<double>(count));              // NaN when every target is ignored, as ATen's
    });
    ctx->save_for_backward({rows, flat, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["count"] = count;
    ctx->saved_data["sizes"] = logits.sizes().vec();
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    HP_CHECK(!at::GradMode::is_enabled(),
             "hp::kernels::cross_entropy: no double backward (create_graph); use cross_entropy_composed");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &rows = saved[0], &targets = saved[1], &lse = saved[2];
    at::Tensor dlogits = at::empty_like(rows);
    run_kernel("cross_entropy_backward", 2 * rows.nbytes(), [&] {
      if (rows.is_meta()) return;
      const double scale = grads[0].item<double>() / static_cast<double>(ctx->saved_data["count"].toInt());
      loops().cross_entropy_backward(rows, targets, ctx->saved_data["ignore_index"].toInt(), lse, scale, dlogits);
    });
    return {dlogits.view(ctx->saved_data["sizes"].toIntVector()), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool cross_entropy_is_fused(const at::Tensor& logits, const at::Tensor& targets) {
  return fusable(logits) && logits.dim() >= 1 && logits.numel() > 0 && targets.scalar_type() == at::kLong &&
         !is_dtensor(targets) && targets.device() == logits.device() && targets.layout() == at::kStrided &&
         targets.sizes() == logits.sizes().slice(0, logits.dim() - 1);
}

at::Tensor cross_entropy_composed(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), {}, at::Reduction::Mean,
                                ignore_index);
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  if (!cross_entropy_is_fused(logits, targets)) return cross_entropy_composed(logits, targets, ignore_index);
  return FusedCrossEntropy::apply(logits, targets, ignore_index);
}

}  // namespace hp::kernels
