#include "parallel/ulysses_exchange.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"

namespace hp::detail {

UlyssesExchange::UlyssesExchange(comm::ProcessGroup group, const at::Tensor& rank_positions)
    : group_(std::move(group)) {
  const int64_t n = group_.size(), total = rank_positions.numel();
  HP_CHECK(rank_positions.dim() == 1 && total % n == 0, "UlyssesExchange: ", total, " positions for ", n, " ranks");
  local_ = total / n;
  const at::Tensor positions = rank_positions.to(at::kLong).contiguous();
  const int64_t* p = positions.data_ptr<int64_t>();
  std::vector<int64_t> order(total);  // order[t]: the index in rank_positions of the t-th smallest
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [p](int64_t a, int64_t b) { return p[a] < p[b]; });
  std::vector<int64_t> sorted(total);
  for (int64_t t = 0; t < total; ++t) {
    sorted[t] = p[order[t]];
    const int64_t rank = order[t] / local_, offset = order[t] % local_;
    Run* last = runs_.empty() ? nullptr : &runs_.back();
    if (last && last->rank == rank && last->offset + last->length == offset) {
      ++last->length;
    } else {
      runs_.push_back({rank, offset, t, 1});
    }
  }
  sorted_ = at::tensor(sorted, at::kLong);
}

at::Tensor UlyssesExchange::gather(const at::Tensor& x) const {
  const int64_t n = group_.size(), b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  HP_CHECK(s == local_, "Ulysses: ", s, " tokens on this rank; the plan expected ", local_);
  // [n (head group), b, h/n, s, d]: a view when b is 1.
  const at::Tensor pieces = x.reshape({b, n, h / n, s, d}).permute({1, 0, 2, 3, 4}).contiguous();
  const at::Tensor received = group_.all_to_all(pieces);  // [n (source rank), b, h/n, s, d]
  at::Tensor out = at::empty({b, h / n, n * s, d}, x.options());
  for (const Run& r : runs_) out.narrow(2, r.at, r.length).copy_(received[r.rank].narrow(2, r.offset, r.length));
  return out;
}

at::Tensor UlyssesExchange::scatter(const at::Tensor& x) const {
  const int64_t n = group_.size(), b = x.size(0), h = x.size(1), d = x.size(3);
  HP_CHECK(x.size(2) == n * local_, "Ulysses: ", x.size(2), " tokens on this rank's heads; the plan expected ",
           n * local_);
  at::Tensor pieces = at::empty({n, b, h, local_, d}, x.options());  // [n (owner rank), b, h, s, d]
  for (const Run& r : runs_) pieces[r.rank].narrow(2, r.offset, r.length).copy_(x.narrow(2, r.at, r.length));
  const at::Tensor received = group_.all_to_all(pieces);  // [n (head group), b, h, s, d]
  return received.permute({1, 0, 2, 3, 4}).reshape({b, n * h, local_, d});
}

at::Tensor UlyssesExchange::sequence_to_heads(const at::Tensor& x) const {
  // The backward holds a copy of this exchange (a group handle and the runs), which the caller's
  // may not outlive.
  return record_backward("UlyssesSequenceToHeadsBackward", x, gather(x.detach()),
                         [exchange = *this](const at::Tensor& grad) { return exchange.scatter(grad.contiguous()); });
}

at::Tensor UlyssesExchange::heads_to_sequence(const at::Tensor& x) const {
  return record_backward("UlyssesHeadsToSequenceBackward", x, scatter(x.detach()),
                         [exchange = *this](const at::Tensor& grad) { return exchange.gather(grad.contiguous()); });
}

}  // namespace hp::detail
