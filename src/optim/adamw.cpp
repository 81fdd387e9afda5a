#include "hp/optim/adamw.h"

#include <ATen/ATen.h>

#include <cmath>
#include <map>

#include "hp/dtensor/local.h"
#include "optim/closure.h"

namespace hp {

at::Tensor AdamW::step(LossClosure closure) {
  if (!foreach_) return torch::optim::AdamW::step(std::move(closure));
  const at::Tensor loss = detail::evaluate_closure(closure);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    // Parameters at the same step share bias corrections: one foreach pass per step value (all of
    // them, after the first step).
    struct Batch {
      std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
    };
    std::map<int64_t, Batch> batches;
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(), "AdamW does not support sparse gradients");
      auto& slot = state()[c10::guts::to_string(p.unsafeGetTensorImpl())];
      if (!slot) {  // as torch::optim::AdamW's first step
        auto s = std::make_unique<torch::optim::AdamWParamState>();
        s->step(0);
        s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
      s.step(s.step() + 1);
      Batch& b = batches[s.step()];
      // DTensor parameter, gradient and state share one layout: update the local pieces.
      b.params.push_back(local_tensor(p));
      b.grads.push_back(local_tensor(p.grad()));
      b.exp_avgs.push_back(local_tensor(s.exp_avg()));
      b.exp_avg_sqs.push_back(local_tensor(s.exp_avg_sq()));
      if (o.amsgrad()) b.max_exp_avg_sqs.push_back(local_tensor(s.max_exp_avg_sq()));
    }
    for (auto& [step, b] : batches) {
      const double bias_correction1 = 1 - std::pow(beta1, step), bias_correction2 = 1 - std::pow(beta2, step);
      if (o.weight_decay() != 0) at::_foreach_mul_(b.params, 1 - o.lr() * o.weight_decay());
      at::_foreach_mul_(b.exp_avgs, beta1);
      at::_foreach_add_(b.exp_avgs, b.grads, 1 - beta1);
      at::_foreach_mul_(b.exp_avg_sqs, beta2);
      at::_foreach_addcmul_(b.exp_avg_sqs, b.grads, b.grads, 1 - beta2);
      std::vector<at::Tensor> denom;
      if (o.amsgrad()) {
        at::_foreach_maximum_(b.max_exp_avg_sqs, b.exp_avg_sqs);
        denom = at::_foreach_sqrt(b.max_exp_avg_sqs);
      } else {
        denom = at::_foreach_sqrt(b.exp_avg_sqs);
      }
      at::_foreach_div_(denom, std::sqrt(bias_correction2));
      at::_foreach_add_(denom, o.eps());
      at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, -o.lr() / bias_correction1);
    }
  }
  return loss;
}

}  // namespace hp
