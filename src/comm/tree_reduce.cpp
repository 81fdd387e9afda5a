#include "hp/comm/tree_reduce.h"

#include <ATen/ATen.h>

#include "hp/core/error.h"

namespace hp::comm {

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

at::Tensor tree_reduce(const at::Tensor& stacked, ReduceOp op, const at::Tensor& out) {
  HP_CHECK(stacked.dim() >= 1 && stacked.size(0) > 0,
           "tree_reduce: needs a non-empty dim 0 to reduce, got shape ", stacked.sizes());
  HP_CHECK(!out.defined() || out.sizes() == stacked.sizes().slice(1), "tree_reduce: out has shape ",
           out.sizes(), " but one slice of the input has shape ", stacked.sizes().slice(1));
  const int64_t count = stacked.size(0);
  if (op == ReduceOp::kMax || op == ReduceOp::kMin) {
    at::Tensor result = op == ReduceOp::kMax ? std::get<0>(stacked.max(0)) : std::get<0>(stacked.min(0));
    return out.defined() ? out.copy_(result) : result;
  }

  // Pair adjacent slices level by level; an odd last slice is carried up unchanged.
  at::Tensor level = stacked;
  at::Tensor total;
  while (!total.defined()) {
    const int64_t n = level.size(0);
    if (n == 1) {
      total = out.defined() ? out.copy_(level[0]) : level[0].clone();  // never alias the input
      break;
    }
    if (n == 2) {  // the root: write straight into `out` when there is one
      at::Tensor target = out;
      total = out.defined() ? at::add_out(target, level[0], level[1]) : level[0] + level[1];
      break;
    }
    const int64_t paired = n - n % 2;
    at::Tensor sums = level.slice(0, 0, paired, 2) + level.slice(0, 1, paired, 2);
    level = (n % 2 == 0) ? sums : at::cat({sums, level.slice(0, n - 1, n)});
  }
  if (op == ReduceOp::kAvg) total.div_(count);
  return total;
}

}  // namespace hp::comm
