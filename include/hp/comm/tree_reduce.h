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

#include "hp/comm/types.h"

namespace hp::comm {

// Returns the reduction of dim 0; when `out` is given (shape of one slice) the result is written
// into it and `out` is returned. `stacked` is left unchanged.
at::Tensor tree_reduce(const at::Tensor& stacked, ReduceOp op, const at::Tensor& out = {});

// The same, using `stacked` as its workspace (its contents are clobbered): no temporaries.
at::Tensor tree_reduce_(const at::Tensor& stacked, ReduceOp op, const at::Tensor& out = {});

}  // namespace hp::comm
