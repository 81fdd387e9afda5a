#include "hp/parallel/loss_parallel.h"

#include <ATen/ATen.h>

#include <memory>

#include "hp/core/error.h"
#include "hp/dtensor/custom.h"
#include "hp/dtensor/dtensor.h"
#include "hp/kernels/cross_entropy.h"

namespace hp {
namespace {

bool vocab_sharded(const at::Tensor& logits) {
  if (!is_dtensor(logits)) return false;
  const DTensor d(logits);
  return d.device_mesh().ndim() == 1 && d.placements()[0].is_shard(d.dim() - 1);
}

// What the backward needs from the forward, per call.
struct Saved {
  at::Tensor log_sum_exp;   // [tokens], over the whole vocabulary
  at::Tensor local_target;  // [tokens], target index within this rank's slice (clamped)
  at::Tensor on_this_rank;  // [tokens], the target lies in this rank's slice (and is not ignored)
  at::Tensor valid;         // [tokens], target != ignore_index
  double count = 0;         // number of valid targets
};

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  const DTensor d(logits);
  const DeviceMesh mesh = d.device_mesh();
  const comm::ProcessGroup& group = mesh.get_group(0);
  const int64_t vocab_offset = d.spec().local_shape_and_offset(*mesh.get_coordinate()).second.back();
  HP_CHECK(!is_dtensor(targets) || DTensor(targets).placements()[0].is_replicate(),
           "cross_entropy: targets must be replicated over the vocabulary-parallel mesh, got ",
           to_string(DTensor(targets).placements()));
  HP_CHECK(targets.sizes() == logits.sizes().slice(0, logits.dim() - 1), "cross_entropy: targets have shape ",
           targets.sizes(), " but logits have shape ", logits.sizes(),
           "; expected the logits' shape without the last dim");
  const at::Tensor target_dt = is_dtensor(targets) ? targets : DTensor::from_local(targets, mesh, {Replicate()});
  auto saved = std::make_shared<Saved>();

  DFunction f;
  f.name = "vocab_parallel_cross_entropy";
  f.input_placements = {{Shard(logits.dim() - 1)}, {Replicate()}};
  f.output_placements = {Replicate()};
  f.forward = [saved, group, vocab_offset, ignore_index](const std::vector<at::Tensor>& local) {
    const at::Tensor slice = local[0].to(at::kFloat).reshape({-1, local[0].size(-1)});
    const at::Tensor target = local[1].reshape({-1});
    const int64_t width = slice.size(1);
    at::Tensor max = width > 0 ? std::get<0>(slice.max(1)) : at::full({slice.size(0)}, -INFINITY, slice.options());
    max = group.all_reduce(max, {comm::ReduceOp::kMax});
    const at::Tensor sum_exp = group.all_reduce((slice - max.unsqueeze(1)).exp().sum(1));
    saved->valid = target.ne(ignore_index);
    const at::Tensor shifted = target - vocab_offset;
    saved->on_this_rank = shifted.ge(0).logical_and(shifted.lt(width)).logical_and(saved->valid);
    saved->local_target = shifted.clamp(0, std::max<int64_t>(width - 1, 0));
    at::Tensor target_logit = width > 0 ? slice.gather(1, saved->local_target.unsqueeze(1)).squeeze(1)
                                        : at::zeros({slice.size(0)}, slice.options());
    target_logit = group.all_reduce(target_logit * saved->on_this_rank);
    saved->log_sum_exp = max + sum_exp.log();
    saved->count = static_cast<double>(saved->valid.sum().item<int64_t>());
    HP_CHECK(saved->count > 0, "cross_entropy: every target equals ignore_index ", ignore_index);
    return ((saved->log_sum_exp - target_logit) * saved->valid).sum().div(saved->count).to(local[0].scalar_type());
  };
  f.backward = [saved](const at::Tensor& grad, const std::vector<at::Tensor>& local) -> std::vector<at::Tensor> {
    const at::Tensor slice = local[0].to(at::kFloat).reshape({-1, local[0].size(-1)});
    at::Tensor g = (slice - saved->log_sum_exp.unsqueeze(1)).exp();  // softmax over the whole vocabulary
    if (g.size(1) > 0)
      g.scatter_add_(1, saved->local_target.unsqueeze(1), -saved->on_this_rank.to(at::kFloat).unsqueeze(1));
    g = g * (saved->valid.to(at::kFloat).unsqueeze(1) * (grad.to(at::kFloat) / saved->count));
    return {g.reshape(local[0].sizes()).to(local[0].scalar_type()), at::Tensor()};
  };
  return f.apply({logits, target_dt}, std::vector<int64_t>{});
}

}  // namespace

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index) {
  HP_CHECK(logits.dim() >= 1, "cross_entropy: logits need a class dim");
  if (vocab_sharded(logits)) return vocab_parallel_cross_entropy(logits, targets, ignore_index);
  return kernels::cross_entropy(logits, targets, ignore_index);
}

}  // namespace hp
