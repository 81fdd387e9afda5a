#include "parallel/ring_attention.h"

#include <ATen/ATen.h>

#include <optional>
#include <utility>

#include "hp/core/error.h"

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
  RingShift(const comm::ProcessGroup& group, const TensorPair& out, int first_tag, int second_tag) {
    const int ranks = group.size(), next = (group.rank() + 1) % ranks, prev = (group.rank() + ranks - 1) % ranks;
    out_ = {out.first.contiguous(), out.second.contiguous()};  // alive until the sends complete
    in_ = {at::empty_like(out_.first), at::empty_like(out_.second)};
    works_ = group.batch_isend_irecv(
        {comm::P2POp::send(out_.first, next, first_tag), comm::P2POp::send(out_.second, next, second_tag),
         comm::P2POp::recv(in_.first, prev, first_tag), comm::P2POp::recv(in_.second, prev, second_tag)});
  }
  // The pair the previous rank sent.
  TensorPair wait() {
    for (comm::Work& w : works_) w.wait();
    return in_;
  }

 private:
  std::vector<comm::Work> works_;
  TensorPair out_, in_;
};

class RingAttentionKernel final : public nn::AttentionKernel {
 public:
  RingAttentionKernel(comm::ProcessGroup group, std::shared_ptr<const nn::AttentionKernel> local,
                      std::vector<at::Tensor> key_positions)
      : group_(std::move(group)), local_(std::move(local)), key_positions_(std::move(key_positions)) {
    HP_CHECK(static_cast<int64_t>(key_positions_.size()) == group_.size(), "ring attention: ", key_positions_.size(),
             " key position vectors for ", group_.size(), " ranks");
  }

  nn::AttentionOutput forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const nn::AttentionMask& mask, double scale) const override {
    const int ranks = group_.size();
    TensorPair kv{k, v};
    nn::AttentionOutput acc;
    for (int step = 0; step < ranks; ++step) {
      std::optional<RingShift> shift;
      if (step + 1 < ranks) shift.emplace(group_, kv, kTagK, kTagV);
      const nn::AttentionOutput part = local_->forward(q, kv.first, kv.second, block_mask(mask, step), scale);
      acc = step == 0 ? part : nn::merge_attention(acc, part);
      if (shift) kv = shift->wait();
    }
    return acc;
  }

  nn::AttentionGrads backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                              const at::Tensor& lse, const at::Tensor& dout, const nn::AttentionMask& mask,
                              double scale) const override {
    const int ranks = group_.size();
    TensorPair kv{k, v};
    at::Tensor dq;
    // The dK/dV accumulator of the keys this rank holds at a step arrives from the previous rank
    // (which added its share the step before) and leaves for the next; after the last step it
    // reaches the keys' owner.
    std::optional<RingShift> accumulator;
    for (int step = 0; step < ranks; ++step) {
      std::optional<RingShift> shift;
      if (step + 1 < ranks) shift.emplace(group_, kv, kTagK, kTagV);
      const nn::AttentionGrads g =
          local_->backward(q, kv.first, kv.second, out, lse, dout, block_mask(mask, step), scale);
      dq = step == 0 ? g.dq : dq.add_(g.dq);
      TensorPair dkv{g.dk, g.dv};
      if (accumulator) {
        const TensorPair arrived = accumulator->wait();
        dkv = {arrived.first.add_(g.dk), arrived.second.add_(g.dv)};
      }
      accumulator.emplace(group_, dkv, kTagDk, kTagDv);
      if (shift) kv = shift->wait();
    }
    const TensorPair own = accumulator->wait();
    return {dq, own.first, own.second};
  }

 private:
  // At `step` this rank holds the keys of the rank `step` places before it.
  nn::AttentionMask block_mask(const nn::AttentionMask& mask, int step) const {
    const int ranks = group_.size(), source = (group_.rank() + ranks - step) % ranks;
    return {mask.causal, mask.q_positions, key_positions_[source]};
  }

  comm::ProcessGroup group_;
  std::shared_ptr<const nn::AttentionKernel> local_;
  std::vector<at::Tensor> key_positions_;
};

}  // namespace

std::shared_ptr<const nn::AttentionKernel> ring_attention_kernel(comm::ProcessGroup group,
                                                                 std::shared_ptr<const nn::AttentionKernel> local,
                                                                 std::vector<at::Tensor> key_positions) {
  return std::make_shared<RingAttentionKernel>(std::move(group), std::move(local), std::move(key_positions));
}

}  // namespace hp::detail
