#include "comm/fake_collectives.h"

#include <ATen/ATen.h>

#include <numeric>

namespace hp::comm::detail::fake {
namespace {

int64_t offset_of(const std::vector<int64_t>& sizes, int index) {
  return std::accumulate(sizes.begin(), sizes.begin() + index, int64_t{0});
}

at::Tensor rows_like(const at::Tensor& t, int64_t rows) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape[0] = rows;
  return at::zeros(shape, t.options());
}

// Copies `piece` into every dim-0 piece of `out` (sizes[r] rows) that has its size.
at::Tensor fill_pieces(at::Tensor out, const std::vector<int64_t>& sizes, const at::Tensor& piece) {
  int64_t offset = 0;
  for (int64_t rows : sizes) {
    if (rows == piece.size(0) && rows > 0) out.narrow(0, offset, rows).copy_(piece);
    offset += rows;
  }
  return out;
}

}  // namespace

at::Tensor all_reduce(const at::Tensor& tensor, ReduceOp op, int n) {
  return op == ReduceOp::kSum ? tensor.mul_(n) : tensor;
}

at::Tensor all_gather(const at::Tensor& x0, const std::vector<int64_t>& sizes, const at::Tensor& into) {
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  return fill_pieces(into.defined() ? into.zero_() : rows_like(x0, total), sizes, x0);
}

at::Tensor reduce_scatter(const at::Tensor& x0, const std::vector<int64_t>& sizes, int rank, ReduceOp op, int n) {
  at::Tensor mine = x0.narrow(0, offset_of(sizes, rank), sizes[rank]).clone();
  return op == ReduceOp::kSum ? mine.mul_(n) : mine;
}

at::Tensor all_to_all(const at::Tensor& input, const std::vector<int64_t>& out_splits,
                      const std::vector<int64_t>& in_splits, int rank) {
  const at::Tensor own = input.narrow(0, offset_of(in_splits, rank), in_splits[rank]);
  const int64_t total = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  return fill_pieces(rows_like(input, total), out_splits, own);
}

}  // namespace hp::comm::detail::fake
