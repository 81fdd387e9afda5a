#include "parallel/ring_attention.h"

#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/kernels/softmax.h"

namespace hp::detail {
namespace {

// Tags keep the two streams of backward apart: K/V of step t+1 travel while the accumulators of
// step t do.
constexpr int kTagK = 0, kTagV = 1, kTagDk = 2, kTagDv = 3;

struct TensorPair {
  at::Tensor first, second;
};

// A pair of tensors on its way from each rank to the next one of the ring.
class RingShift {
 public:
  RingShift(const comm::ProcessGroup& group, const TensorPair& out, int first_tag, int second_tag, bool overlap) {
    const int ranks = group.size(), next = (group.rank() + 1) % ranks, prev = (group.rank() + ranks - 1) % ranks;
    out_ = {out.first.contiguous(), out.second.contiguous()};  // alive until the sends complete
    in_ = {at::empty_like(out_.first), at::empty_like(out_.second)};
    works_ = group.batch_isend_irecv(
        {comm::P2POp::send(out_.first, next, first_tag), comm::P2POp::send(out_.second, next, second_tag),
         comm::P2POp::recv(in_.first, prev, first_tag), comm::P2POp::recv(in_.second, prev, second_tag)});
    if (!overlap) wait();
  }
  // The pair the previous rank sent; the pair this rank sent is let go.
  TensorPair wait() {
    for (comm::Work& w : works_) w.wait();
    works_.clear();
    out_ = {};
    return in_;
  }

 private:
  std::vector<comm::Work> works_;
  TensorPair out_, in_;
};

}  // namespace

class RingFirstShift {
 public:
  RingFirstShift(const comm::ProcessGroup& group, const at::Tensor& k, const at::Tensor& v, bool overlap) {
    shift.emplace(group, TensorPair{k, v}, kTagK, kTagV, overlap);
  }
  std::optional<RingShift> shift;  // until a kernel's forward takes it
};

namespace {

class RingAttentionKernel final : public nn::AttentionKernel {
 public:
  RingAttentionKernel(comm::ProcessGroup group, std::shared_ptr<const nn::AttentionKernel> local,
                      std::vector<at::Tensor> key_positions, bool overlap, std::shared_ptr<RingFirstShift> first)
      : group_(std::move(group)), local_(std::move(local)), overlap_(overlap), first_(std::move(first)) {
    HP_CHECK(static_cast<int64_t>(key_positions.size()) == group_.size(), "ring attention: ", key_positions.size(),
             " key position vectors for ", group_.size(), " ranks");
    // Every rank sorts its tokens once per call and sends its keys sorted, so the local kernel
    // finds every block in order and copies nothing per step.
    for (const at::Tensor& p : key_positions) sorted_positions_.push_back(nn::PositionOrder(p).positions);
    own_ = std::make_unique<nn::PositionOrder>(key_positions[group_.rank()]);
    HP_CHECK(!first_ || !own_->order.defined(),
             "ring attention: K and V were sent ahead (start_ring_shift) in an order that is not their positions'");
  }

  nn::AttentionOutput forward(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                              const nn::AttentionMask& mask, double scale) const override {
    const int ranks = group_.size();
    const at::Tensor q = own_->take(q_in);
    TensorPair kv{own_->take(k), own_->take(v)};
    nn::AttentionOutput acc;
    std::shared_ptr<RingFirstShift> first = std::exchange(first_, nullptr);  // K and V already on their way
    for (int step = 0; step < ranks; ++step) {
      std::optional<RingShift> shift;
      if (step == 0 && first && first->shift) {
        shift = std::exchange(first->shift, std::nullopt);
      } else if (step + 1 < ranks) {
        shift.emplace(group_, kv, kTagK, kTagV, overlap_);
      }
      const nn::AttentionOutput part = local_->forward(q, kv.first, kv.second, block_mask(mask, step), scale);
      acc = step == 0 ? part : nn::merge_attention(acc, part);
      if (shift) kv = shift->wait();
    }
    return {own_->put_back(acc.out), own_->put_back(acc.lse)};
  }

  nn::AttentionGrads backward(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& dout_in,
                              const nn::AttentionMask& mask, double scale) const override {
    const int ranks = group_.size();
    const at::Tensor q = own_->take(q_in), out = own_->take(out_in), lse = own_->take(lse_in),
                     dout = own_->take(dout_in);
    TensorPair kv{own_->take(k), own_->take(v)};
    // The sums the kernel adds into: dq stays; the dK/dV sum of the keys this rank holds at a step
    // arrives from the previous rank (which added its share the step before), takes this rank's
    // share and leaves for the next; after the last step it reaches the keys' owner. Waiting for it
    // before the step's compute gives up overlapping its transfer, and saves the step's own
    // gradients and a second pair in flight (docs/context_parallel.md#memory).
    const auto acc = q.options().dtype(kernels::accumulation_type(q));
    const at::Tensor dq = at::zeros(q.sizes(), acc);
    std::optional<RingShift> accumulator;
    for (int step = 0; step < ranks; ++step) {
      std::optional<RingShift> shift;
      if (step + 1 < ranks) shift.emplace(group_, kv, kTagK, kTagV, overlap_);
      const TensorPair dkv = accumulator
                                 ? accumulator->wait()
                                 : TensorPair{at::zeros(kv.first.sizes(), acc), at::zeros(kv.second.sizes(), acc)};
      local_->backward_into(q, kv.first, kv.second, out, lse, dout, block_mask(mask, step), scale,
                            {dq, dkv.first, dkv.second});
      accumulator.emplace(group_, dkv, kTagDk, kTagDv, overlap_);
      if (shift) kv = shift->wait();
    }
    const TensorPair own = accumulator->wait();
    return {own_->put_back(dq), own_->put_back(own.first), own_->put_back(own.second)};
  }

 private:
  // At `step` this rank holds the keys of the rank `step` places before it (sorted).
  nn::AttentionMask block_mask(const nn::AttentionMask& mask, int step) const {
    const int ranks = group_.size(), source = (group_.rank() + ranks - step) % ranks;
    return {mask.causal, own_->positions, sorted_positions_[source], mask.dropout};
  }

  comm::ProcessGroup group_;
  std::shared_ptr<const nn::AttentionKernel> local_;
  std::vector<at::Tensor> sorted_positions_;  // of each rank's tokens
  std::unique_ptr<nn::PositionOrder> own_;    // this rank's tokens (its queries and keys alike)
  bool overlap_;
  mutable std::shared_ptr<RingFirstShift> first_;  // the forward's first exchange, if started before it
};

}  // namespace

std::shared_ptr<const nn::AttentionKernel> ring_attention_kernel(comm::ProcessGroup group,
                                                                 std::shared_ptr<const nn::AttentionKernel> local,
                                                                 std::vector<at::Tensor> key_positions, bool overlap,
                                                                 std::shared_ptr<RingFirstShift> first) {
  return std::make_shared<RingAttentionKernel>(std::move(group), std::move(local), std::move(key_positions), overlap,
                                               std::move(first));
}

std::shared_ptr<RingFirstShift> start_ring_shift(const comm::ProcessGroup& group, const at::Tensor& k,
                                                 const at::Tensor& v, bool overlap) {
  at::NoGradGuard no_grad;  // what the ring sends is data; the kernel's backward sends the gradients
  return std::make_shared<RingFirstShift>(group, k.detach(), v.detach(), overlap);
}

void finish_ring_shift(RingFirstShift& first) {
  if (first.shift) std::exchange(first.shift, std::nullopt)->wait();
}

}  // namespace hp::detail
