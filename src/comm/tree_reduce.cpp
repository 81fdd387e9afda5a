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

at::Tensor tree_reduce(const at::Tensor& stacked, ReduceOp op) {
  HP_CHECK(stacked.dim() >= 1 && stacked.size(0) > 0,
           "tree_reduce: needs a non-empty dim 0 to reduce, got shape ", stacked.sizes());
  const int64_t count = stacked.size(0);
  if (op == ReduceOp::kMax) return std::get<0>(stacked.max(0));
  if (op == ReduceOp::kMin) return std::get<0>(stacked.min(0));

  at::Tensor level = stacked;
  while (level.size(0) > 1) {
    const int64_t n = level.size(0);
    const int64_t paired = n - n % 2;
    at::Tensor sums = level.slice(0, 0, paired, 2) + level.slice(0, 1, paired, 2);
    level = (n % 2 == 0) ? sums : at::cat({sums, level.slice(0, n - 1, n)});
  }
  at::Tensor total = level.select(0, 0);
  if (count == 1) total = total.clone();  // never alias the input
  if (op == ReduceOp::kAvg) total.div_(count);
  return total;
}

}  // namespace hp::comm
