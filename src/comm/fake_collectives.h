// The results of collectives on a fake world's groups (hp::comm::fake_world): the right shapes with
// no peers. Meta tensors stay meta; a tensor with values gets what a symmetric world would give it,
// one where every rank contributes what this rank contributes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "hp/comm/types.h"

namespace hp::comm::detail::fake {

// In place: a sum multiplies by the group size `n`; avg, max and min leave the tensor as it is.
at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op, int n);
// Dim-0 pieces of sizes[r] rows: piece r is this rank's input x0 where sizes[r] is its size, else
// zeros; into `into` (contiguous, sum(sizes) rows) when given.
at::Tensor all_gather(const at::Tensor& x0, const std::vector<int64_t>& sizes, const at::Tensor& into = {});
// This rank's dim-0 piece (sizes[rank] rows) of x0 reduced over n equal contributions.
at::Tensor reduce_scatter(const at::Tensor& x0, const std::vector<int64_t>& sizes, int rank, ReduceOp op, int n);
// Every rank sends this rank what this rank sends itself: piece r of the output is this rank's own
// piece where out_splits[r] is its size, else zeros.
at::Tensor all_to_all(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                      const std::vector<int64_t>& in_splits, int rank);

}  // namespace hp::comm::detail::fake
