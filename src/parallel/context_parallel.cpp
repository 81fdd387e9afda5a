#include "hp/parallel/context_parallel.h"

#include <ATen/ATen.h>

#include <algorithm>

#include <memory>
#include <optional>
#include <utility>

#include "hp/comm/functional.h"
#include "hp/core/error.h"
#include "hp/nn/attention.h"
#include "parallel/ring_attention.h"
#include "parallel/ulysses_exchange.h"

namespace hp {
namespace {

// The global positions that ranks [first, first + count) of `ranks` hold together, in rank order:
// one piece of the sequence's order (contiguous, or head_tail_order with load_balance), each rank's
// ascending. In ascending order a rank's tokens go to the attention kernel as they lie: ring
// attention copies nothing to sort them (q, k, v, the output and its gradient), and Ulysses's
// exchange gathers a group's tokens in ascending order (UlyssesExchange) for the same reason.
at::Tensor positions_of_ranks(int64_t seq, int64_t ranks, int64_t first, int64_t count, bool load_balance) {
  HP_CHECK(ranks > 0 && first >= 0 && count > 0 && first + count <= ranks, "cp_positions: ranks [", first, ", ",
           first + count, ") of ", ranks);
  const int64_t pieces = load_balance ? 2 * ranks : ranks;
  HP_CHECK(seq > 0 && seq % pieces == 0, "context parallelism: the sequence length ", seq, " must divide by ", pieces,
           load_balance ? " (2 x cp, for the load-balanced head-tail cut)" : " (cp)");
  const int64_t local = seq / ranks, begin = first * local, end = (first + count) * local;
  if (!load_balance) return at::arange(begin, end, at::kLong);
  std::vector<int64_t> order = head_tail_order(seq);
  for (int64_t rank_begin = begin; rank_begin < end; rank_begin += local)
    std::sort(order.begin() + rank_begin, order.begin() + rank_begin + local);
  return at::tensor(at::ArrayRef<int64_t>(order.data() + begin, end - begin), at::kLong);
}

void check_ulysses_kv_heads(int64_t kv_heads, int64_t n) {
  HP_CHECK(kv_heads % n == 0 || n % kv_heads == 0, "ContextParallel (Ulysses): ", kv_heads,
           " key/value heads (on this rank) neither divide by nor divide the Ulysses degree ", n);
}

void check_ulysses_heads(int64_t query_heads, int64_t kv_heads, int64_t n) {
  HP_CHECK(query_heads % n == 0, "ContextParallel (Ulysses): ", query_heads,
           " query heads (on this rank) do not divide by the Ulysses degree ", n);
  check_ulysses_kv_heads(kv_heads, n);
}

// Key/value heads for a Ulysses group of n: split as they are when n divides them, else each
// repeated so that every rank gets the one its query heads use.
at::Tensor kv_heads_for_ulysses(const at::Tensor& kv, int64_t n) {
  const int64_t heads = kv.size(1);
  return heads % n == 0 ? kv : kv.repeat_interleave(n / heads, 1);
}

void check_same_tokens(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t s = k.size(2);
  HP_CHECK((!q.defined() || q.size(2) == s) && v.size(2) == s,
           "ContextParallel: q, k and v must hold the same tokens; got ", q.defined() ? q.sizes() : at::IntArrayRef{},
           ", ", k.sizes(), ", ", v.sizes());
}

const comm::AllGatherOptions kAlongSequence{2, {}};

// What begin() started with a call's K and V: the all-gathers or Ulysses exchanges in flight, or
// the ring's first exchange.
struct KeysOnTheirWay final : nn::KeysInFlight {
  using nn::KeysInFlight::KeysInFlight;
  void finish() override {
    if (k) k->wait();
    if (v) v->wait();
    if (ring) detail::finish_ring_shift(*ring);
  }
  std::optional<comm::functional::PendingCollective> k, v;
  std::optional<detail::UlyssesExchange> exchange;
  std::shared_ptr<detail::RingFirstShift> ring;
};

class ContextParallelCompute final : public nn::AttentionCompute {
 public:
  ContextParallelCompute(comm::ProcessGroup group, CpMode mode, bool load_balance, int64_t ulysses_degree,
                         bool ring_overlap, bool async)
      : group_(std::move(group)), mode_(mode), load_balance_(load_balance), ring_overlap_(ring_overlap), async_(async) {
    const int64_t ranks = group_.size(), rank = group_.rank();
    if (mode_ == CpMode::kRing) ring_ = group_;
    if (mode_ == CpMode::kUlysses) ulysses_ = group_;
    if (mode_ == CpMode::kHybrid) {
      // cp rank c = ring index c / u, Ulysses index c % u: Ulysses groups are neighbouring ranks.
      const int64_t u = ulysses_degree;
      std::vector<int> ulysses_ranks, ring_ranks;
      for (int64_t i = 0; i < u; ++i) ulysses_ranks.push_back(group_.ranks()[rank / u * u + i]);
      for (int64_t j = 0; j < ranks / u; ++j) ring_ranks.push_back(group_.ranks()[j * u + rank % u]);
      ulysses_ = group_.new_group(ulysses_ranks, group_.name() + ".ulysses");
      ring_ = group_.new_group(ring_ranks, group_.name() + ".ring");
    }
  }

  at::Tensor positions(int64_t local_len) const override {
    return cp_positions(local_len * group_.size(), group_.size(), group_.rank(), load_balance_);
  }

  std::string name() const override { return "ContextParallel(" + to_string(mode_) + ")"; }

  std::shared_ptr<nn::KeysInFlight> begin(const at::Tensor& k, const at::Tensor& v) const override {
    // Inference tensors keep no version, which KeysInFlight compares: those are exchanged at the
    // call (on every rank alike).
    if (!async_ || group_.size() == 1 || k.is_inference() || v.is_inference()) return nullptr;
    check_same_tokens({}, k, v);
    auto early = std::make_shared<KeysOnTheirWay>(k, v);
    if (mode_ == CpMode::kAllGather) {
      early->k = comm::functional::all_gather_async(k, group_, kAlongSequence);
      early->v = comm::functional::all_gather_async(v, group_, kAlongSequence);
    } else if (ulysses_.defined()) {
      const int64_t u = ulysses_.size();
      check_ulysses_kv_heads(k.size(1), u);  // the query heads are checked at the call
      early->exchange.emplace(ulysses_exchange(k.size(2)));
      early->k = early->exchange->start_sequence_to_heads(kv_heads_for_ulysses(k, u));
      early->v = early->exchange->start_sequence_to_heads(kv_heads_for_ulysses(v, u));
    } else {
      early->ring = detail::start_ring_shift(ring_, k, v, ring_overlap_);
    }
    return early;
  }

  at::Tensor attend(std::shared_ptr<const nn::AttentionKernel> kernel, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, bool causal, double scale, const nn::AttentionDropout& dropout,
                    std::shared_ptr<nn::KeysInFlight> begun) const override {
    check_same_tokens(q, k, v);
    auto* early = dynamic_cast<KeysOnTheirWay*>(begun.get());
    HP_CHECK(early != nullptr || begun == nullptr, "ContextParallel: the keys were begun by another compute");
    const int64_t s = q.size(2), ranks = group_.size();
    // The positions cp ranks [first, first + count) hold together.
    auto positions_of = [&](int64_t first, int64_t count) {
      return positions_of_ranks(s * ranks, ranks, first, count, load_balance_);
    };
    if (ranks == 1)
      return nn::attention(kernel, q, k, v, {causal, positions_of(0, 1), positions_of(0, 1), dropout}, scale);
    if (mode_ == CpMode::kAllGather) {
      const at::Tensor all_k = early ? early->k->wait() : comm::functional::all_gather(k, group_, kAlongSequence);
      const at::Tensor all_v = early ? early->v->wait() : comm::functional::all_gather(v, group_, kAlongSequence);
      return nn::attention(kernel, q, all_k, all_v,
                           {causal, positions_of(group_.rank(), 1), positions_of(0, ranks), dropout}, scale);
    }
    // The tokens this rank attends for (after Ulysses, its group's, gathered in ascending order),
    // and the ring peers' tokens.
    const int64_t u = ulysses_.defined() ? ulysses_.size() : 1;
    // Sorted only when they are not ascending already (one rank's are: cp_positions sorts its chunks).
    auto group_positions = [&](int64_t first_rank) { return nn::PositionOrder(positions_of(first_rank, u)).positions; };
    const int64_t my_first = group_.rank() / u * u;
    std::shared_ptr<const nn::AttentionKernel> inner = kernel;
    if (ring_.defined()) {
      std::vector<at::Tensor> key_positions;
      for (int64_t j = 0; j < ring_.size(); ++j) key_positions.push_back(group_positions(j * u));
      inner = detail::ring_attention_kernel(ring_, kernel, std::move(key_positions), ring_overlap_,
                                            early ? early->ring : nullptr);
    }
    if (!ulysses_.defined()) {
      const at::Tensor mine = group_positions(my_first);
      return nn::attention(inner, q, k, v, {causal, mine, mine, dropout}, scale);
    }
    check_ulysses_heads(q.size(1), k.size(1), u);
    const detail::UlyssesExchange exchange = early ? *early->exchange : ulysses_exchange(s);
    nn::AttentionMask mask{causal, exchange.positions(), exchange.positions(), dropout};
    mask.dropout.first_head += ulysses_.rank() * (q.size(1) / u);  // sequence_to_heads' share of the heads
    // In this order on every rank (K and V first when begin() sent them ahead).
    const at::Tensor heads_q = exchange.sequence_to_heads(q);
    const at::Tensor heads_k = early ? early->k->wait() : exchange.sequence_to_heads(kv_heads_for_ulysses(k, u));
    const at::Tensor heads_v = early ? early->v->wait() : exchange.sequence_to_heads(kv_heads_for_ulysses(v, u));
    return exchange.heads_to_sequence(nn::attention(inner, heads_q, heads_k, heads_v, mask, scale));
  }

 private:
  // The exchange of this rank's Ulysses group for `local_len` tokens per rank.
  detail::UlyssesExchange ulysses_exchange(int64_t local_len) const {
    const int64_t ranks = group_.size(), u = ulysses_.size();
    return detail::UlyssesExchange(
        ulysses_, positions_of_ranks(local_len * ranks, ranks, group_.rank() / u * u, u, load_balance_));
  }

  comm::ProcessGroup group_, ring_, ulysses_;
  CpMode mode_;
  bool load_balance_;
  bool ring_overlap_;
  bool async_;
};

}  // namespace

std::string to_string(CpMode mode) {
  switch (mode) {
    case CpMode::kRing:
      return "ring";
    case CpMode::kAllGather:
      return "allgather";
    case CpMode::kUlysses:
      return "ulysses";
    case CpMode::kHybrid:
      return "hybrid";
  }
  return "?";
}

CpMode cp_mode_named(const std::string& name) {
  for (CpMode m : {CpMode::kRing, CpMode::kAllGather, CpMode::kUlysses, CpMode::kHybrid})
    if (to_string(m) == name) return m;
  HP_FAIL("unknown context-parallel mode '", name, "' (ring, allgather, ulysses or hybrid)");
}

std::vector<int64_t> head_tail_order(int64_t seq) {
  HP_CHECK(seq >= 0 && seq % 2 == 0, "head_tail_order: the sequence length ", seq, " must be even");
  std::vector<int64_t> order;
  order.reserve(seq);
  for (int64_t i = 0; i < seq / 2; ++i) {
    order.push_back(i);
    order.push_back(seq - 1 - i);
  }
  return order;
}

at::Tensor cp_positions(int64_t seq, int64_t ranks, int64_t rank, bool load_balance) {
  return positions_of_ranks(seq, ranks, rank, 1, load_balance);
}

at::Tensor cp_shard(const at::Tensor& x, int64_t dim, int64_t ranks, int64_t rank, bool load_balance) {
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  HP_CHECK(d >= 0 && d < x.dim(), "cp_shard: dim ", dim, " of a ", x.dim(), "-d tensor");
  return x.index_select(d, cp_positions(x.size(d), ranks, rank, load_balance).to(x.device()));
}

at::Tensor cp_unshard(const at::Tensor& local, int64_t dim, const comm::ProcessGroup& group, bool load_balance) {
  const int64_t d = dim < 0 ? dim + local.dim() : dim;
  HP_CHECK(d >= 0 && d < local.dim(), "cp_unshard: dim ", dim, " of a ", local.dim(), "-d tensor");
  const at::Tensor gathered = group.all_gather(local.contiguous(), comm::AllGatherOptions{d, {}});
  const at::Tensor positions = positions_of_ranks(gathered.size(d), group.size(), 0, group.size(), load_balance);
  return at::empty_like(gathered).index_copy_(d, positions.to(local.device()), gathered);
}

void ContextParallel::check_heads(int64_t ranks, int64_t q_heads, int64_t kv_heads) const {
  if (mode_ == CpMode::kHybrid)
    HP_CHECK(ulysses_degree_ > 1 && ulysses_degree_ < ranks && ranks % ulysses_degree_ == 0,
             "ContextParallel(hybrid): the Ulysses degree ", ulysses_degree_,
             " must be above 1, below cp and divide cp (", ranks, ")");
  if (mode_ == CpMode::kUlysses) check_ulysses_heads(q_heads, kv_heads, ranks);
  if (mode_ == CpMode::kHybrid) check_ulysses_heads(q_heads, kv_heads, ulysses_degree_);
}

void ContextParallel::check(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  HP_CHECK(dynamic_cast<nn::CoreAttention*>(&module) != nullptr, "ContextParallel applies to CoreAttention modules; ",
           fqn, " is a ", module.name());
  HP_CHECK(mesh.ndim() == 1, "ContextParallel needs a 1-D mesh (the cp dim); got ", mesh.str());
  // The heads are known at the first call; here only the degree (heads pass with one per rank).
  if (mode_ == CpMode::kHybrid) check_heads(mesh.size(0), ulysses_degree_, ulysses_degree_);
}

void ContextParallel::apply(nn::Module& module, const std::string& fqn, const DeviceMesh& mesh) const {
  check(module, fqn, mesh);
  auto& core = static_cast<nn::CoreAttention&>(module);
  core.set_compute(std::make_shared<ContextParallelCompute>(mesh.get_group(0), mode_, load_balance_, ulysses_degree_,
                                                            ring_overlap_, async_));
}

}  // namespace hp
