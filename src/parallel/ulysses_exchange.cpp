#include "parallel/ulysses_exchange.h"

#include <ATen/ATen.h>

#include <utility>

#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"
#include "hp/nn/attention.h"

namespace hp::detail {

UlyssesExchange::UlyssesExchange(comm::ProcessGroup group, const at::Tensor& rank_positions)
    : group_(std::move(group)) {
  const int64_t n = group_.size(), total = rank_positions.numel();
  HP_CHECK(rank_positions.dim() == 1 && rank_positions.device().is_cpu() && total % n == 0, "UlyssesExchange: ", total,
           " positions (on ", rank_positions.device(), ") for ", n, " ranks; they belong on the host");
  local_ = total / n;
  const nn::PositionOrder ascending(rank_positions.to(at::kLong));
  const at::Tensor order = ascending.order.defined() ? ascending.order.contiguous() : at::Tensor();
  const int64_t* source = order.defined() ? order.data_ptr<int64_t>() : nullptr;  // into rank_positions
  for (int64_t t = 0; t < total; ++t) {
    const int64_t from = source ? source[t] : t;
    const int64_t rank = from / local_, offset = from % local_;
    Run* last = runs_.empty() ? nullptr : &runs_.back();
    if (last && last->rank == rank && last->offset + last->length == offset) {
      ++last->length;
    } else {
      runs_.push_back({rank, offset, t, 1});
    }
  }
  sorted_ = ascending.positions;
}

at::Tensor UlyssesExchange::pieces_to_send(const at::Tensor& x) const {
  const int64_t n = group_.size(), b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  HP_CHECK(s == local_, "Ulysses: ", s, " tokens on this rank; the plan expected ", local_);
  HP_CHECK(h % n == 0, "Ulysses: ", h, " heads on this rank do not divide by the Ulysses degree ", n);
  // [n (head group), b, h/n, s, d]: a view when x is contiguous and b is 1.
  return x.reshape({b, n, h / n, s, d}).permute({1, 0, 2, 3, 4}).contiguous();
}

at::Tensor UlyssesExchange::arrange(const at::Tensor& received, const at::Tensor& x) const {
  // received: [n (source rank), b, h/n, s, d].
  const int64_t n = group_.size(), b = x.size(0), h = x.size(1), d = x.size(3);
  at::Tensor out = at::empty({b, h / n, n * local_, d}, x.options());
  for (const Run& r : runs_) out.narrow(2, r.at, r.length).copy_(received[r.rank].narrow(2, r.offset, r.length));
  return out;
}

at::Tensor UlyssesExchange::gather(const at::Tensor& x) const {
  return arrange(group_.all_to_all(pieces_to_send(x)), x);
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
  return record_sequence_to_heads(x, gather(x.detach()));
}

// The backwards hold a copy of this exchange (a group handle and the runs): the caller's is gone by
// the time they run.
at::Tensor UlyssesExchange::record_sequence_to_heads(const at::Tensor& x, at::Tensor gathered) const {
  return record_backward("UlyssesSequenceToHeadsBackward", x, std::move(gathered),
                         [exchange = *this](const at::Tensor& grad) { return exchange.scatter(grad); });
}

comm::functional::PendingCollective UlyssesExchange::start_sequence_to_heads(const at::Tensor& x) const {
  const at::Tensor pieces = pieces_to_send(x.detach());
  comm::Work work = group_.all_to_all_async(pieces);
  // The work holds `pieces` until it is sent.
  return comm::functional::PendingCollective(std::move(work), [exchange = *this, x](at::Tensor received) {
    return exchange.record_sequence_to_heads(x, exchange.arrange(received, x));
  });
}

at::Tensor UlyssesExchange::heads_to_sequence(const at::Tensor& x) const {
  return record_backward("UlyssesHeadsToSequenceBackward", x, scatter(x.detach()),
                         [exchange = *this](const at::Tensor& grad) { return exchange.gather(grad); });
}

}  // namespace hp::detail
