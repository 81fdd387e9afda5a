#include "hp/kernels/softmax.h"

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "hp/core/error.h"
#include "hp/core/kernel_observer.h"
#include "kernels/fusable.h"
#include "kernels/per_capability/loops.h"

namespace hp::kernels {
namespace {

// The same by ATen ops, for devices the loops do not serve (a GPU build's).
at::Tensor composed_softmax(const at::Tensor& scores, const at::Tensor& visible, double scale, at::Tensor& lse,
                            at::ScalarType dtype) {
  at::Tensor s = scores.to(accumulation_type(scores)).mul_(scale);  // scores in that dtype are overwritten
  const at::Tensor key = at::arange(s.size(2), visible.options()).unsqueeze(0);
  s.masked_fill_((key >= visible.unsqueeze(1)).to(s.device()), -INFINITY);
  if (!lse.defined()) lse = at::logsumexp(s, -1);
  const at::Tensor finite = lse.masked_fill(at::isinf(lse), 0.0);
  return s.sub_(finite.unsqueeze(-1)).exp_().to(dtype);
}

}  // namespace

at::Tensor masked_softmax(const at::Tensor& scores, const at::Tensor& visible, double scale, at::Tensor& lse,
                          std::optional<at::ScalarType> dtype) {
  const at::ScalarType out_dtype = dtype.value_or(accumulation_type(scores));
  HP_CHECK(scores.dim() == 3 && visible.dim() == 1 && visible.size(0) == scores.size(1) &&
               visible.scalar_type() == at::kLong && visible.device().is_cpu(),
           "masked_softmax: scores must be [n, rows, keys] and visible int64 [rows] on the host; got ", scores.sizes(),
           " and ", visible.sizes(), " ", visible.scalar_type());
  HP_CHECK(
      !lse.defined() || (lse.sizes() == scores.sizes().slice(0, 2) && lse.scalar_type() == accumulation_type(scores)),
      "masked_softmax: lse must be [n, rows] in ", accumulation_type(scores), "; got ", lse.sizes(), " ",
      lse.scalar_type());
  const at::Tensor v = visible.contiguous();
  const int64_t* seen = v.data_ptr<int64_t>();
  for (int64_t r = 0; r < v.numel(); ++r)
    HP_CHECK(seen[r] >= 0 && seen[r] <= scores.size(2), "masked_softmax: row ", r, " sees ", seen[r], " keys of ",
             scores.size(2));
  if (!fusable(scores) || scores.numel() == 0 || (out_dtype != at::kFloat && out_dtype != at::kBFloat16))
    return composed_softmax(scores, visible, scale, lse, out_dtype);
  const at::Tensor s = scores.contiguous();
  const bool compute_lse = !lse.defined();
  at::Tensor out_lse = compute_lse ? at::empty(s.sizes().slice(0, 2), s.options().dtype(at::kFloat)) : lse.contiguous();
  // fp32 scores become the probabilities in place (row by row, each read before it is written).
  const bool in_place = s.scalar_type() == at::kFloat && out_dtype == at::kFloat && s.is_same(scores);
  at::Tensor probs = in_place ? s : at::empty(s.sizes(), s.options().dtype(out_dtype));
  // Written through its data, so say so: whoever kept the scores (a checkpoint's saved product)
  // finds them changed, loudly, rather than replaying probabilities as scores.
  if (in_place) s.unsafeGetTensorImpl()->bump_version();
  run_kernel("softmax_forward", s.nbytes() + probs.nbytes(), [&] {
    if (!s.is_meta()) loops().softmax_forward(s, v, scale, compute_lse, out_lse, probs);
  });
  if (compute_lse) lse = out_lse;
  return probs;
}

at::Tensor softmax_scores_grad(const at::Tensor& probs, at::Tensor dprobs, const at::Tensor& row, double scale,
                               std::optional<at::ScalarType> dtype) {
  const auto acc = probs.scalar_type();
  const at::ScalarType out_dtype = dtype.value_or(acc);
  HP_CHECK(probs.sizes() == dprobs.sizes() && probs.dim() >= 1 && row.numel() * probs.size(-1) == probs.numel() &&
               dprobs.scalar_type() == acc && row.scalar_type() == acc,
           "softmax_scores_grad: probs and dprobs must be [..., keys] and row [...], of one dtype; got ", probs.sizes(),
           " ", acc, ", ", dprobs.sizes(), " ", dprobs.scalar_type(), ", ", row.sizes(), " ", row.scalar_type());
  if (acc != at::kFloat || !fusable(probs) || !dprobs.is_contiguous() || probs.numel() == 0 ||
      (out_dtype != at::kFloat && out_dtype != at::kBFloat16)) {
    const at::Tensor per_row = row.reshape(probs.sizes().slice(0, probs.dim() - 1)).unsqueeze(-1);
    return probs.mul(dprobs.sub_(per_row)).mul_(scale).to(out_dtype);
  }
  const at::Tensor p = probs.contiguous(), r = row.contiguous();
  at::Tensor out = out_dtype == at::kFloat ? dprobs : at::empty(p.sizes(), p.options().dtype(out_dtype));
  run_kernel("softmax_backward", 2 * p.nbytes() + out.nbytes(), [&] {
    if (!p.is_meta()) loops().softmax_backward(p, r, scale, dprobs, out);
  });
  return out;
}

}  // namespace hp::kernels
