// The fixed association order of deterministic reductions.
//
// tree_reduce(stacked, op) reduces dim 0 of `stacked` (one slice per rank or per micro-batch) with a
// left-complete balanced binary tree: adjacent pairs are combined level by level, an odd element at
// the end of a level is carried up unchanged. Equivalently sum(v[lo:hi]) = sum(v[lo:lo+p]) +
// sum(v[lo+p:hi]) where p is the largest power of two below hi - lo. Every aligned power-of-two
// block is a subtree, so a sum of 4 values is ((v0+v1)+(v2+v3)) whether one rank adds all four, or
// two ranks add pairs and a 2-rank collective adds the results. kAvg divides the tree sum by the
// count; kMax/kMin are exact in any order.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

#include "hp/comm/types.h"

namespace hp::comm {

// Returns the reduction of dim 0; when `out` is given (shape of one slice) the result is written
// into it and `out` is returned. `stacked` is left unchanged.
at::Tensor tree_reduce(const at::Tensor& stacked, ReduceOp op, const at::Tensor& out = {});

// The same, using `stacked` as its workspace (its contents are clobbered): no temporaries.
at::Tensor tree_reduce_(const at::Tensor& stacked, ReduceOp op, const at::Tensor& out = {});

// tree_reduce's association for values that arrive one at a time (the gradients of successive
// micro-batches): a binary counter of partial sums, so at most log2(n) + 1 tensors are held. After
// n adds, take() is tree_reduce(kSum) of the n values stacked, bit for bit.
class TreeSum {
 public:
  // Holds `value` (no copy): the caller must not change it afterwards.
  void add(at::Tensor value);
  bool empty() const { return partial_.empty(); }
  // The sum of everything added (undefined if nothing was); empty afterwards.
  at::Tensor take();

 private:
  std::vector<std::pair<int, at::Tensor>> partial_;  // (level, sum of 2^level values), oldest first
};

}  // namespace hp::comm
