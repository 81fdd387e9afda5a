#include "hp/optim/clip_grad.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "hp/core/error.h"
#include "hp/core/exact_square_sum.h"
#include "hp/core/storage_tier.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"

namespace hp {
namespace {

// Whether this rank's piece of `grad` is the one that counts: the first copy along every mesh
// dim that replicates it.
bool counts_here(const at::Tensor& grad, const comm::ProcessGroup& world) {
  if (!is_dtensor(grad)) return world.rank() == 0;
  const DTensorSpec& spec = DTensor(grad).spec();
  const auto coordinate = spec.mesh().get_coordinate();
  if (!coordinate) return false;
  for (int64_t d = 0; d < spec.mesh().ndim(); ++d) {
    const Placement& p = spec.placements()[d];
    HP_CHECK(!p.is_partial(), "clip_grad_norm_: a gradient is ", to_string(spec.placements()),
             "; reduce Partial gradients first (plans and fully_shard do)");
    if (p.is_replicate() && (*coordinate)[d] != 0) return false;
  }
  return true;
}

// The one number of a norm on the host. A dry run's gradients are on the meta device: their norm
// has no value (NaN), and the gradients are left as they are.
at::Tensor on_host(const at::Tensor& t) { return t.is_meta() ? t : t.to(at::kCPU); }
double value_of(const at::Tensor& t) {
  return t.is_meta() ? std::numeric_limits<double>::quiet_NaN() : t.item<double>();
}

}  // namespace

double clip_grad_norm_(const std::vector<at::Tensor>& params, double max_norm, const comm::ProcessGroup& world,
                       double norm_type, const std::vector<at::Tensor>& copies, double* local_norm) {
  const bool inf = std::isinf(norm_type);
  HP_CHECK(inf || norm_type == 2.0, "clip_grad_norm_: norm_type must be 2 or infinity, got ", norm_type);
  HP_CHECK(max_norm >= 0.0, "clip_grad_norm_: max_norm must be non-negative, got ", max_norm);
  std::vector<at::Tensor> counted;
  for (const at::Tensor& p : params) {
    const at::Tensor& grad = p.grad();
    if (grad.defined() && counts_here(grad, world) && local_tensor(grad).numel() > 0)
      counted.push_back(local_tensor(grad));
  }
  double norm = 0.0, mine = 0.0;
  if (inf) {
    // Where the gradients are, like the 2-norm's sum below: one number reaches the host.
    at::Tensor largest;
    use_in_turn(counted, [&](const at::Tensor& g) {
      const at::Tensor here = g.abs().max().to(at::kDouble);
      largest = largest.defined() ? at::maximum(largest, here) : here;
    });
    const at::Tensor most = largest.defined() ? on_host(largest.view({1})) : at::zeros({1}, at::kDouble);
    mine = value_of(most);
    norm = value_of(world.all_reduce(most, {comm::ReduceOp::kMax}));
  } else if (world.options().deterministic) {
    // Exact: the same bits however the gradients are split over ranks (exact_square_sum.h).
    ExactSquareSum squares;
    use_in_turn(counted, [&](const at::Tensor& g) { squares.add(g); });
    mine = std::sqrt(squares.value());
    norm = std::sqrt(ExactSquareSum::value_of_digits(world.all_reduce(squares.digits())));
  } else {
    // Accumulated in double (the sum runs over millions of squares) where the gradients are, so that a
    // GPU's gradients reach the host as one number, not one per tensor.
    at::Tensor sum;
    use_in_turn(counted, [&](const at::Tensor& g) {
      const at::Tensor squares = g.to(at::kDouble).pow(2).sum();
      sum = sum.defined() ? sum + squares : squares;
    });
    const at::Tensor total = sum.defined() ? on_host(sum.view({1})) : at::zeros({1}, at::kDouble);
    mine = std::sqrt(value_of(total));
    norm = std::sqrt(value_of(world.all_reduce(total)));
  }
  if (local_norm) *local_norm = mine;
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const auto* group : {&params, &copies})
      for (const at::Tensor& p : *group)
        if (p.grad().defined()) grads.push_back(local_tensor(p.grad()));
    use_in_turn(grads, [&](const at::Tensor& g) { g.mul_(coef); });
  }
  return norm;
}

}  // namespace hp
