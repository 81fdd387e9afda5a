#include "hp/optim/adamw.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "hp/core/error.h"
#include "hp/dtensor/local.h"
#include "optim/builtin_kinds.h"
#include "optim/closure.h"
#include "optim/state_in_tier.h"

namespace hp {
namespace {

// Adam and AdamW keep the same fields under different types, and create them alike on the first step.
template <typename Options, typename ParamState>
void init_adam_state(const torch::optim::OptimizerOptions& options, const at::Tensor& p,
                     std::unique_ptr<torch::optim::OptimizerParamState>& slot) {
  auto s = std::make_unique<ParamState>();
  s->step(0);
  s->exp_avg(detail::zero_state_like(p));
  s->exp_avg_sq(detail::zero_state_like(p));
  if (static_cast<const Options&>(options).amsgrad()) s->max_exp_avg_sq(detail::zero_state_like(p));
  slot = std::move(s);
}

// The local pieces of the parameters one foreach pass updates, and their gradients and state.
struct Batch {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;

  std::vector<at::Tensor> tensors() const {
    std::vector<at::Tensor> all;
    for (const auto* list : {&params, &grads, &exp_avgs, &exp_avg_sqs, &max_exp_avg_sqs})
      all.insert(all.end(), list->begin(), list->end());
    return all;
  }

  // Parameters [lo, hi).
  Batch slice(size_t lo, size_t hi) const {
    const auto part = [&](const std::vector<at::Tensor>& list) {
      return list.empty() ? list : std::vector<at::Tensor>(list.begin() + lo, list.begin() + hi);
    };
    return {part(params), part(grads), part(exp_avgs), part(exp_avg_sqs), part(max_exp_avg_sqs)};
  }

  // With state in an offload tier (hp/parallel/offload.h), runs of parameters whose tensors take
  // about kChunkBytes, so that a file tier brings in one chunk while the one before updates and
  // settles each once done (ZeRO-Infinity's sub-groups): the step then holds two chunks in memory,
  // not the whole state. Without, the batch whole. The updates are elementwise per tensor, so the
  // chunks change no bit.
  std::vector<Batch> chunks() const {
    constexpr int64_t kChunkBytes = int64_t{8} << 20;
    const bool offloaded =
        std::any_of(params.begin(), params.end(), [](const at::Tensor& p) { return storage_tier_of(p) != nullptr; });
    if (!offloaded) return {*this};
    std::vector<Batch> out;
    size_t lo = 0;
    int64_t bytes = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      bytes += params[i].numel() * static_cast<int64_t>(params[i].element_size()) * (max_exp_avg_sqs.empty() ? 4 : 5);
      if (bytes >= kChunkBytes || i + 1 == params.size()) {
        out.push_back(slice(lo, i + 1));
        lo = i + 1;
        bytes = 0;
      }
    }
    return out;
  }
};

// One foreach step of one AdamW group: the update of torch::optim::AdamW, bitwise.
void adamw_foreach_step(torch::optim::OptimizerParamGroup& group, OptimizerStateMap& state) {
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  // Parameters at the same step share bias corrections: one foreach pass per step value (all of
  // them, after the first step).
  std::map<int64_t, Batch> batches;
  for (const at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    TORCH_CHECK(!p.grad().is_sparse(), "AdamW does not support sparse gradients");
    auto& slot = state[optimizer_state_key(p)];
    if (!slot) init_adam_state<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(o, p, slot);
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
  for (auto& [step, whole] : batches) {
    const double bias_correction1 = 1 - std::pow(beta1, step), bias_correction2 = 1 - std::pow(beta2, step);
    const std::vector<Batch> chunks = whole.chunks();
    prefetch_storage(chunks.front().tensors());
    for (size_t c = 0; c < chunks.size(); ++c) {
      if (c + 1 < chunks.size()) prefetch_storage(chunks[c + 1].tensors());
      const Batch& b = chunks[c];
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
      settle_storage(b.tensors());
    }
  }
}

template <typename Options, typename ParamState>
class AdamStateKind : public OptimizerKind {
 public:
  explicit AdamStateKind(std::string name) : name_(std::move(name)) {}
  std::string name() const override { return name_; }
  void init_state(const torch::optim::OptimizerOptions& options, const at::Tensor& p,
                  std::unique_ptr<torch::optim::OptimizerParamState>& slot) const override {
    init_adam_state<Options, ParamState>(options, p, slot);
  }
  ParamStateFields fields(torch::optim::OptimizerParamState& state) const override {
    auto& s = static_cast<ParamState&>(state);
    ParamStateFields out{{{"exp_avg", s.exp_avg()}, {"exp_avg_sq", s.exp_avg_sq()}}, s.step()};
    if (s.max_exp_avg_sq().defined()) out.tensors.emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
    return out;
  }
  void set_step(torch::optim::OptimizerParamState& state, int64_t step) const override {
    static_cast<ParamState&>(state).step(step);
  }

 private:
  std::string name_;
};

class AdamWKind : public AdamStateKind<torch::optim::AdamWOptions, torch::optim::AdamWParamState> {
 public:
  AdamWKind() : AdamStateKind("AdamW") {}
  bool can_step_group() const override { return true; }
  void step_group(torch::optim::OptimizerParamGroup& group, OptimizerStateMap& state) const override {
    adamw_foreach_step(group, state);
  }
};

}  // namespace

at::Tensor AdamW::step(LossClosure closure) {
  if (!foreach_) {
    // LibTorch's step makes its state in the compute allocator and steps on all of it at once.
    for (const auto& group : param_groups())
      for (const at::Tensor& p : group.params())
        HP_CHECK(storage_tier_of(local_tensor(p)) == nullptr,
                 "hp::AdamW: a parameter lives in an offload tier, which the foreach step handles; foreach=false ",
                 "does not (it would keep the state in the compute allocator)");
    return torch::optim::AdamW::step(std::move(closure));
  }
  const at::Tensor loss = detail::evaluate_closure(closure);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups()) adamw_foreach_step(group, state());
  return loss;
}

namespace detail {
std::shared_ptr<const OptimizerKind> adamw_kind() { return std::make_shared<AdamWKind>(); }
std::shared_ptr<const OptimizerKind> adam_kind() {
  return std::make_shared<AdamStateKind<torch::optim::AdamOptions, torch::optim::AdamParamState>>("Adam");
}
}  // namespace detail

}  // namespace hp
