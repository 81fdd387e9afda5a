#include "hp/nn/attention.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"
#include "hp/dtensor/random.h"
#include "hp/kernels/softmax.h"

namespace hp::nn {
namespace {

thread_local AttentionWorkCounter* current_counter = nullptr;

// The dtype the matrix products take their factors in: bf16 for bf16 inputs (the CPU's bf16 units,
// fp32 accumulation inside, the result rounded to bf16), else the accumulation dtype (LibTorch
// 1.13 has no CPU fp16 matmul).
at::ScalarType product_type(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? at::kBFloat16 : kernels::accumulation_type(t);
}

// Whether `positions` (int64 on the host; undefined means 0, 1, ...) are ascending, so that
// PositionOrder moves nothing.
bool ascending(const at::Tensor& positions) {
  if (!positions.defined()) return true;
  const at::Tensor p = positions.contiguous();
  const int64_t* first = p.data_ptr<int64_t>();
  return std::is_sorted(first, first + p.numel());
}

at::Tensor positions_or_iota(const at::Tensor& positions, int64_t n, const char* what) {
  if (!positions.defined()) return at::arange(n, at::kLong);
  HP_CHECK(positions.dim() == 1 && positions.size(0) == n && positions.scalar_type() == at::kLong &&
               positions.device().is_cpu(),
           "attention: ", what, " must be int64 [", n, "] on the host; got ", positions.sizes(), " ",
           positions.scalar_type());
  return positions.contiguous();
}

// One problem laid out for the blockwise loop: grouped-query heads folded so that the query rows of
// a key/value head are one matrix, everything sorted by position. q, k and v are kept in the
// product dtype; scores, probabilities, the log-sum-exp and every sum are in the accumulation dtype.
class Problem {
 public:
  Problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask, double scale,
          int64_t query_block)
      : causal_(mask.causal), scale_(scale), query_block_(query_block), dropout_(mask.dropout) {
    HP_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
             "attention: q, k and v must be [batch, heads, seq, head_dim]; got ", q.sizes(), ", ", k.sizes(), ", ",
             v.sizes());
    HP_CHECK(!q.requires_grad() && !k.requires_grad() && !v.requires_grad(),
             "attention kernel: inputs must not require grad (hp::nn::attention records autograd)");
    b_ = q.size(0);
    hkv_ = k.size(1);
    sq_ = q.size(2);
    sk_ = k.size(2);
    HP_CHECK(k.size(0) == b_ && v.size(0) == b_ && v.size(1) == hkv_ && v.size(2) == sk_ && k.size(3) == q.size(3),
             "attention: shapes do not match: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
    HP_CHECK(hkv_ > 0 && q.size(1) % hkv_ == 0, "attention: query heads ", q.size(1),
             " are not a multiple of key/value heads ", hkv_);
    rep_ = q.size(1) / hkv_;
    device_ = q.device();
    acc_ = kernels::accumulation_type(q);
    mm_ = product_type(q);
    qp_.emplace(positions_or_iota(mask.q_positions, sq_, "q_positions"));
    kp_.emplace(positions_or_iota(mask.k_positions, sk_, "k_positions"));
    q_ = group(q, mm_);
    k_ = kp_->take(k).to(mm_).contiguous();
    v_ = kp_->take(v).to(mm_).contiguous();
    if (dropout_.p > 0.0) check_dropout(q.size(1));
  }

  // [b, hq, sq, d] (query order) -> [b, hkv, rep, sq, d] sorted, in `dtype` (the accumulation dtype
  // by default).
  at::Tensor group(const at::Tensor& t, std::optional<at::ScalarType> dtype = std::nullopt) const {
    return qp_->take(t).to(dtype.value_or(acc_)).reshape({b_, hkv_, rep_, sq_, t.size(3)}).contiguous();
  }
  // a times b with factors in the product dtype; the result in the accumulation dtype.
  at::Tensor product(const at::Tensor& a, const at::Tensor& b) const {
    return at::matmul(a.to(mm_), b.to(mm_)).to(acc_);
  }
  // The inverse of group.
  at::Tensor ungroup(const at::Tensor& t) const { return qp_->put_back(t.reshape({b_, hkv_ * rep_, sq_, t.size(-1)})); }
  at::Tensor ungroup_rows(const at::Tensor& t) const {  // [b, hkv, rep, sq] -> [b, hq, sq]
    return ungroup(t.unsqueeze(-1)).squeeze(-1);
  }
  at::Tensor unsort_keys(const at::Tensor& t) const { return kp_->put_back(t); }

  struct Block {
    int64_t begin, rows, keys;  // query rows [begin, begin + rows) see at most the first `keys` keys
    at::Tensor visible;         // int64 [rows] on the host: how many of the first keys each row sees
  };
  std::vector<Block> blocks() const {
    std::vector<Block> out;
    const int64_t* qp = qp_->positions.data_ptr<int64_t>();
    const int64_t* kp = kp_->positions.data_ptr<int64_t>();
    for (int64_t begin = 0; begin < sq_; begin += query_block_) {
      const int64_t rows = std::min(query_block_, sq_ - begin);
      Block block{begin, rows, sk_, at::full({rows}, sk_, at::kLong)};
      if (causal_) {
        int64_t* visible = block.visible.data_ptr<int64_t>();
        for (int64_t r = 0; r < rows; ++r) visible[r] = std::upper_bound(kp, kp + sk_, qp[begin + r]) - kp;
        block.keys = visible[rows - 1];  // positions are sorted: the last row sees the most
      }
      if (block.keys > 0) out.push_back(std::move(block));
    }
    return out;
  }

  int64_t unmasked_scores() const {
    if (!causal_) return b_ * hkv_ * rep_ * sq_ * sk_;
    const int64_t* qp = qp_->positions.data_ptr<int64_t>();
    const int64_t* kp = kp_->positions.data_ptr<int64_t>();
    int64_t seen = 0;
    for (int64_t i = 0; i < sq_; ++i) seen += std::upper_bound(kp, kp + sk_, qp[i]) - kp;
    return b_ * hkv_ * rep_ * seen;
  }

  // The block's dropout factors (0 or 1 / (1 - p)) as [b, hkv, rep * rows, keys]; undefined without
  // dropout. By global index ((row * heads + head) * 2^21 + q position) * 2^21 + k position.
  at::Tensor keep(const Block& block) const {
    if (dropout_.p <= 0.0) return {};
    const auto along = [](const at::Tensor& t, int64_t dim) {  // t as a [1, .., n, .., 1] index of 5 dims
      std::vector<int64_t> shape(5, 1);
      shape[dim] = t.numel();
      return t.reshape(shape);
    };
    const at::Tensor rows = at::arange(dropout_.first_row, dropout_.first_row + b_, at::kLong);
    const at::Tensor heads =
        at::arange(dropout_.first_head, dropout_.first_head + hkv_ * rep_, at::kLong).view({1, hkv_, rep_, 1, 1});
    const at::Tensor row_head = along(rows, 0) * dropout_.heads + heads;  // [b, hkv, rep, 1, 1]
    const at::Tensor index =
        (row_head * kPositions + along(qp_->positions.narrow(0, block.begin, block.rows), 3)) * kPositions +
        along(kp_->positions.narrow(0, 0, block.keys), 4);
    at::Tensor keep = at::empty(index.sizes(), at::TensorOptions().dtype(acc_));
    philox_fill_at(keep, index, dropout_.seed, dropout_.stream, RandomFill::kBernoulli, 1.0 - dropout_.p, 0.0);
    return keep.mul_(1.0 / (1.0 - dropout_.p)).view({b_, hkv_, rep_ * block.rows, block.keys}).to(device_);
  }

  // The block's queries as [b, hkv, rep * rows, dqk], its keys and values.
  at::Tensor block_rows(const at::Tensor& grouped, const Block& block) const {
    return grouped.narrow(3, block.begin, block.rows).reshape({b_, hkv_, rep_ * block.rows, grouped.size(-1)});
  }
  at::Tensor keys(const Block& block) const { return k_.narrow(2, 0, block.keys); }
  at::Tensor values(const Block& block) const { return v_.narrow(2, 0, block.keys); }

  // exp(scores - lse) of a block, [b, hkv, rep * rows, keys], in `dtype`; masked scores give 0,
  // and so do rows whose lse is -inf (they see no key). With `lse` undefined, computes and returns
  // it instead.
  at::Tensor probabilities(const Block& block, at::Tensor& lse, at::ScalarType dtype) const {
    at::Tensor scores =  // in the product dtype: the kernel widens it
        at::matmul(block_rows(q_, block), keys(block).transpose(-2, -1)).view({-1, block.rows, block.keys});
    // Scores in the accumulation dtype are scaled by an ATen op in place, then become the
    // probabilities in place: activation checkpointing sees the product change and drops what it
    // saved of it (attention's scores must not pile up), and one buffer serves the block.
    double scale = scale_;
    if (scores.scalar_type() == acc_) scores.mul_(std::exchange(scale, 1.0));
    at::Tensor row_lse = lse.defined() ? lse.reshape({-1, block.rows}) : at::Tensor();
    const at::Tensor probs = kernels::masked_softmax(scores, block.visible, scale, row_lse, dtype);
    if (!lse.defined()) lse = row_lse.view({b_, hkv_, rep_, block.rows});
    return probs.view({b_, hkv_, rep_ * block.rows, block.keys});
  }

  int64_t b_, hkv_, rep_, sq_, sk_;
  c10::Device device_{c10::kCPU};  // q's: masks and dropout factors made on the host go there
  at::ScalarType acc_, mm_;
  at::Tensor q_, k_, v_;  // in the product dtype

 private:
  static constexpr int64_t kPositions = int64_t{1} << 21;  // dropout indices: positions below 2^21

  void check_dropout(int64_t q_heads) const {
    const AttentionDropout& d = dropout_;
    HP_CHECK(d.p < 1.0, "attention dropout: p must be below 1; got ", d.p);
    HP_CHECK(d.first_row >= 0 && d.first_row + b_ <= d.global_rows, "attention dropout: rows [", d.first_row, ", ",
             d.first_row + b_, ") are not rows of the global batch of ", d.global_rows);
    HP_CHECK(d.first_head >= 0 && d.first_head + q_heads <= d.heads, "attention dropout: heads [", d.first_head, ", ",
             d.first_head + q_heads, ") are not heads of the model's ", d.heads);
    // Checked on the global batch, so that every layout fails alike.
    HP_CHECK(d.global_rows * d.heads <= kPositions, "attention dropout: the global batch's ", d.global_rows, " rows x ",
             d.heads, " heads exceed the ", kPositions, " its mask indices hold");
    for (const PositionOrder* order : {&*qp_, &*kp_}) {
      const int64_t n = order->positions.numel();
      const int64_t* sorted = order->positions.data_ptr<int64_t>();
      HP_CHECK(n == 0 || (sorted[0] >= 0 && sorted[n - 1] < kPositions), "attention dropout: positions must be in [0, ",
               kPositions, ")");
    }
  }

  bool causal_;
  double scale_;
  int64_t query_block_;
  AttentionDropout dropout_;
  std::optional<PositionOrder> qp_, kp_;  // set by the constructor
};

class CpuAttentionKernel final : public AttentionKernel {
 public:
  explicit CpuAttentionKernel(int64_t query_block) : query_block_(query_block) {
    HP_CHECK(query_block > 0, "cpu_attention_kernel: query_block must be positive; got ", query_block);
  }

  AttentionOutput forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask,
                          double scale) const override {
    const Problem p(q, k, v, mask, scale, query_block_);
    note_attention_work(p.unmasked_scores());
    const auto options = q.options().dtype(p.acc_);
    at::Tensor out = at::zeros({p.b_, p.hkv_, p.rep_, p.sq_, v.size(3)}, options);
    at::Tensor lse = at::full({p.b_, p.hkv_, p.rep_, p.sq_}, -INFINITY, options);
    for (const Problem::Block& block : p.blocks()) {
      at::Tensor block_lse;
      // Without dropout the probabilities come in the product dtype, as the product takes them.
      const at::Tensor keep = p.keep(block);
      at::Tensor probs = p.probabilities(block, block_lse, keep.defined() ? p.acc_ : p.mm_);
      if (keep.defined()) probs.mul_(keep);
      out.narrow(3, block.begin, block.rows)
          .copy_(p.product(probs, p.values(block)).view({p.b_, p.hkv_, p.rep_, block.rows, v.size(3)}));
      lse.narrow(3, block.begin, block.rows).copy_(block_lse);
    }
    return {p.ungroup(out), p.ungroup_rows(lse)};
  }

  AttentionGrads backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                          const at::Tensor& lse, const at::Tensor& dout, const AttentionMask& mask,
                          double scale) const override {
    const Problem p(q, k, v, mask, scale, query_block_);
    const auto acc = q.options().dtype(p.acc_);
    const at::Tensor dq = at::zeros(p.q_.sizes(), acc), dk = at::zeros(p.k_.sizes(), acc),
                     dv = at::zeros(p.v_.sizes(), acc);
    add_grads(p, out, lse, dout, scale, dq, dk, dv);
    return {p.ungroup(dq), p.unsort_keys(dk), p.unsort_keys(dv)};
  }

  void backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                     const at::Tensor& lse, const at::Tensor& dout, const AttentionMask& mask, double scale,
                     const AttentionGrads& sum) const override {
    // The sums are the kernel's own accumulators where its layout is theirs: positions ascending
    // (no sorting), contiguous, in the accumulation dtype. Otherwise backward's gradients are added.
    const at::ScalarType acc = kernels::accumulation_type(q);
    const auto own_layout = [&](const at::Tensor& t, const at::Tensor& like) {
      return t.scalar_type() == acc && t.is_contiguous() && t.sizes() == like.sizes();
    };
    if (!ascending(mask.q_positions) || !ascending(mask.k_positions) || !own_layout(sum.dq, q) ||
        !own_layout(sum.dk, k) || !own_layout(sum.dv, v)) {
      AttentionKernel::backward_into(q, k, v, out, lse, dout, mask, scale, sum);
      return;
    }
    const Problem p(q, k, v, mask, scale, query_block_);
    add_grads(p, out, lse, dout, scale, sum.dq.view(p.q_.sizes()), sum.dk, sum.dv);
  }

 private:
  int64_t query_block_;

  // Adds the gradients to dq [b, hkv, rep, sq, dqk] (grouped, sorted), dk and dv (sorted), in the
  // accumulation dtype.
  static void add_grads(const Problem& p, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                        double scale, const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
    const at::Tensor dout_g = p.group(dout);
    const at::Tensor lse_g = p.group(lse.unsqueeze(-1)).squeeze(-1);
    // D_i = sum_j dout_ij out_ij: the softmax backward's row term, from the (global) output.
    const at::Tensor row_term = (dout_g * p.group(out)).sum(-1);
    const at::Tensor dout_factor = p.mm_ == p.acc_ ? dout_g : p.group(dout, p.mm_);  // for the products
    const at::Tensor v_acc = p.v_.to(p.acc_);                                        // for the probabilities' gradient
    for (const Problem::Block& block : p.blocks()) {
      at::Tensor block_lse = lse_g.narrow(3, block.begin, block.rows);
      const at::Tensor probs = p.probabilities(block, block_lse, p.acc_);
      const at::Tensor dout_b = p.block_rows(dout_factor, block);
      // With dropout Z: out = (P Z) v, so dv = (P Z)^T dout and the probabilities' gradient is
      // Z (dout v^T); the softmax's row term sum(dout * out) is unchanged.
      const at::Tensor keep = p.keep(block);
      dv.narrow(2, 0, block.keys).add_(p.product((keep.defined() ? probs * keep : probs).transpose(-2, -1), dout_b));
      // In the accumulation dtype: dprobs - row cancels nearly, and row comes from the (global)
      // output, so a rounded dprobs would leave its rounding error in dscores whole.
      at::Tensor dprobs = at::matmul(p.block_rows(dout_g, block), v_acc.narrow(2, 0, block.keys).transpose(-2, -1));
      if (keep.defined()) dprobs.mul_(keep);
      const at::Tensor row = row_term.narrow(3, block.begin, block.rows).reshape({p.b_, p.hkv_, -1, 1});
      const at::Tensor dscores = kernels::softmax_scores_grad(probs, dprobs, row, scale, p.mm_);  // for products
      dq.narrow(3, block.begin, block.rows)
          .add_(p.product(dscores, p.keys(block)).view({p.b_, p.hkv_, p.rep_, block.rows, p.q_.size(4)}));
      dk.narrow(2, 0, block.keys).add_(p.product(dscores.transpose(-2, -1), p.block_rows(p.q_, block)));
    }
  }
};

class LocalCompute final : public AttentionCompute {
 public:
  at::Tensor attend(std::shared_ptr<const AttentionKernel> kernel, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, bool causal, double scale, const AttentionDropout& dropout,
                    std::shared_ptr<KeysInFlight> /*early: nothing begun*/) const override {
    return attention(std::move(kernel), q, k, v, AttentionMask{causal, {}, {}, dropout}, scale);
  }
  at::Tensor positions(int64_t local_len) const override { return at::arange(local_len, at::kLong); }
  std::string name() const override { return "local"; }
};

}  // namespace

PositionOrder::PositionOrder(const at::Tensor& p) : positions(p.contiguous()) {
  const int64_t* first = positions.data_ptr<int64_t>();
  if (std::is_sorted(first, first + positions.numel())) return;
  auto sorted = at::sort(positions, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  positions = std::get<0>(sorted).contiguous();
  order = std::get<1>(sorted);
}

bool positions_in_order(const at::Tensor& positions) {
  if (!positions.defined()) return true;
  const at::Tensor p = positions.contiguous();
  const int64_t* value = p.data_ptr<int64_t>();
  for (int64_t i = 0; i < p.numel(); ++i)
    if (value[i] != i) return false;
  return true;
}

at::Tensor PositionOrder::put_back(const at::Tensor& sorted) const {
  return order.defined() ? at::empty_like(sorted).index_copy_(2, order.to(sorted.device()), sorted) : sorted;
}

std::shared_ptr<const AttentionKernel> cpu_attention_kernel(int64_t query_block) {
  return std::make_shared<CpuAttentionKernel>(query_block);
}

void AttentionKernel::backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                                    const AttentionMask& mask, double scale, const AttentionGrads& sum) const {
  const AttentionGrads g = backward(q, k, v, out, lse, dout, mask, scale);
  sum.dq.add_(g.dq);
  sum.dk.add_(g.dk);
  sum.dv.add_(g.dv);
}

AttentionOutput merge_attention(const AttentionOutput& acc, const AttentionOutput& block) {
  const at::Tensor top = at::maximum(acc.lse, block.lse);
  const at::Tensor shift = top.masked_fill(at::isinf(top), 0.0);
  const at::Tensor w_acc = (acc.lse - shift).exp_();
  const at::Tensor w_block = (block.lse - shift).exp_();
  const at::Tensor total = w_acc + w_block;
  at::Tensor lse = total.log() + shift;
  // Rows that see no key on either side: total 0; divide by 1 to keep their out at 0.
  const at::Tensor divisor = total.masked_fill(total == 0, 1.0).unsqueeze(-1);
  at::Tensor out = (acc.out * w_acc.unsqueeze(-1) + block.out * w_block.unsqueeze(-1)).div_(divisor);
  return {std::move(out), std::move(lse)};
}

at::Tensor attention(std::shared_ptr<const AttentionKernel> kernel, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const AttentionMask& mask, double scale) {
  AttentionOutput result;
  {
    at::NoGradGuard no_grad;
    result = kernel->forward(q.detach(), k.detach(), v.detach(), mask, scale);
  }
  at::Tensor out = result.out.to(q.scalar_type());
  // The backward keeps a detached alias of out: holding out itself would hold its own node.
  return record_backward(
      "attention", {q, k, v}, out,
      [kernel = std::move(kernel), q = q.detach(), k = k.detach(), v = v.detach(), out = out.detach(),
       lse = std::move(result.lse), mask, scale](const at::Tensor& dout) {
        at::NoGradGuard no_grad;
        const AttentionGrads g = kernel->backward(q, k, v, out, lse, dout, mask, scale);
        return std::vector<at::Tensor>{g.dq.to(q.scalar_type()), g.dk.to(k.scalar_type()), g.dv.to(v.scalar_type())};
      });
}

AttentionWorkCounter::AttentionWorkCounter() : outer_(current_counter) { current_counter = this; }
AttentionWorkCounter::~AttentionWorkCounter() { current_counter = outer_; }

void note_attention_work(int64_t unmasked) {
  for (AttentionWorkCounter* c = current_counter; c != nullptr; c = c->outer_) c->unmasked_ += unmasked;
}

CoreAttention::CoreAttention(bool causal_, double scale_, double dropout_, int64_t heads)
    : Module("CoreAttention"),
      causal(causal_),
      scale(scale_),
      dropout(dropout_),
      kernel_(default_attention_kernel()),
      compute_(std::make_shared<LocalCompute>()),
      model_heads_(heads) {
  HP_CHECK(dropout >= 0.0 && dropout < 1.0, "CoreAttention: dropout must be in [0, 1); got ", dropout);
  HP_CHECK(heads >= 0, "CoreAttention: heads must be >= 0; got ", heads);
}

void CoreAttention::seed(uint64_t seed) {
  seed_ = seed;
  draws_.reset();
}

void CoreAttention::set_heads(int64_t first, int64_t total) {
  HP_CHECK(first >= 0 && total > first, "CoreAttention::set_heads: heads from ", first, " of ", total);
  first_head_ = first;
  heads_ = total;
}

void CoreAttention::set_kernel(std::shared_ptr<const AttentionKernel> kernel) {
  HP_CHECK(kernel != nullptr, "CoreAttention::set_kernel: null kernel");
  kernel_ = std::move(kernel);
}

void CoreAttention::set_compute(std::shared_ptr<const AttentionCompute> compute) {
  HP_CHECK(compute != nullptr, "CoreAttention::set_compute: null compute");
  if (early_) std::exchange(early_, nullptr)->finish();  // begun by the compute being replaced
  compute_ = std::move(compute);
}

void CoreAttention::begin(const at::Tensor& k, const at::Tensor& v) {
  if (early_) std::exchange(early_, nullptr)->finish();
  // A call wrapper (this module checkpointed alone) calls with tensors of its own, never these.
  if (!has_call_wrapper()) early_ = compute_->begin(k, v);
}

at::Tensor CoreAttention::forward_inputs(const Inputs& inputs) {
  HP_CHECK(inputs.size() == 3, "CoreAttention takes q, k and v; got ", inputs.size(), " inputs");
  std::shared_ptr<KeysInFlight> early = std::exchange(early_, nullptr);
  // What was begun with other keys is finished and dropped: every rank runs the same code, so every
  // rank drops it, and the call's own exchange follows it on every rank.
  if (early && !early->began_with(inputs[1], inputs[2])) std::exchange(early, nullptr)->finish();
  const at::Tensor& q = inputs[0];
  const double s = scale > 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  AttentionDropout drop;
  if (is_training() && dropout > 0.0) {
    HP_CHECK(heads_ > 0 || model_heads_ == 0 || q.size(1) == model_heads_, "CoreAttention: ", q.size(1),
             " of the model's ", model_heads_,
             " query heads reach this rank, but no plan said which (set_heads): attention dropout would draw the "
             "masks of the model's first heads on every rank");
    const Draw draw = draws_.next();
    drop = {dropout,
            seed_,
            draw.stream,
            draw.where ? draw.where->first_row : 0,
            draw.where ? draw.where->global_rows : q.size(0),
            first_head_,
            heads_ > 0 ? heads_ : q.size(1)};
  }
  return compute_->attend(kernel_, q, inputs[1], inputs[2], causal, s, drop, std::move(early));
}

}  // namespace hp::nn
