#include "hp/comm/tree_reduce.h"

#include <ATen/ATen.h>

#include "hp/core/error.h"

namespace hp::comm {

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

at::Tensor tree_reduce(const at::Tensor& stacked, ReduceOp op, const at::Tensor& out) {
  if (op == ReduceOp::kMax || op == ReduceOp::kMin) return tree_reduce_(stacked, op, out);  // never writes
  return tree_reduce_(stacked.clone(), op, out);
}

at::Tensor tree_reduce_(const at::Tensor& stacked, ReduceOp op, const at::Tensor& out) {
  HP_CHECK(stacked.dim() >= 1 && stacked.size(0) > 0, "tree_reduce: needs a non-empty dim 0 to reduce, got shape ",
           stacked.sizes());
  HP_CHECK(!out.defined() || out.sizes() == stacked.sizes().slice(1), "tree_reduce: out has shape ", out.sizes(),
           " but one slice of the input has shape ", stacked.sizes().slice(1));
  const int64_t n = stacked.size(0);
  if (op == ReduceOp::kMax || op == ReduceOp::kMin) {
    at::Tensor result = op == ReduceOp::kMax ? std::get<0>(stacked.max(0)) : std::get<0>(stacked.min(0));
    return out.defined() ? out.copy_(result) : result;
  }
  // In place, by strides 1, 2, 4, ...: slot i (a multiple of 2s) absorbs slot i + s. That combines
  // the blocks [i, i+s) and [i+s, i+2s) exactly as the level-by-level pairing does, with a short
  // last block carried up until it finds its partner.
  at::Tensor total;
  if (n == 1) {
    total = out.defined() ? out.copy_(stacked[0]) : stacked[0].clone();
  } else {
    for (int64_t s = 1;; s *= 2) {
      const int64_t pairs = (n - s + 2 * s - 1) / (2 * s);  // slots i = 0, 2s, ... with i + s < n
      if (s * 2 >= n) {                                     // the root: slot 0 absorbs slot s
        at::Tensor target = out;
        total = out.defined() ? at::add_out(target, stacked[0], stacked[s]) : stacked[0] + stacked[s];
        break;
      }
      stacked.slice(0, 0, (pairs - 1) * 2 * s + 1, 2 * s).add_(stacked.slice(0, s, (pairs - 1) * 2 * s + s + 1, 2 * s));
    }
  }
  if (op == ReduceOp::kAvg) total.div_(n);
  return total;
}

void TreeSum::add(at::Tensor value) {
  partial_.emplace_back(0, std::move(value));
  while (partial_.size() >= 2 && partial_[partial_.size() - 1].first == partial_[partial_.size() - 2].first) {
    at::Tensor right = std::move(partial_.back().second);
    partial_.pop_back();
    partial_.back().second = partial_.back().second + right;
    ++partial_.back().first;
  }
}

// The blocks are complete subtrees, largest first; folding them right to left gives the
// left-complete tree: sum(v[lo:hi]) = sum(v[lo:lo+p]) + sum(v[lo+p:hi]).
at::Tensor TreeSum::take() {
  if (partial_.empty()) return {};
  at::Tensor sum = std::move(partial_.back().second);
  partial_.pop_back();
  while (!partial_.empty()) {
    sum = partial_.back().second + sum;
    partial_.pop_back();
  }
  return sum;
}

}  // namespace hp::comm
