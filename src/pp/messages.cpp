#include "pp/messages.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "hp/core/error.h"
#include "pp/failure_notice.h"
#include "pp/placement.h"

namespace hp::pp {
namespace {

// One tag per (direction, stage, micro-batch); shape messages and inference have ranges of their own.
constexpr int kMaxStages = 4096;
int tag(bool backward, int stage, int micro_batch, int micro_batches) {
  return ((backward ? 1 : 0) * kMaxStages + stage) * (micro_batches + 1) + micro_batch + 1;
}
int shape_tag(int stage) { return (1 << 28) + stage; }
int dynamic_shape_tag(int stage, int micro_batch, int micro_batches) {
  return (1 << 27) + tag(false, stage, micro_batch, micro_batches);
}
int inference_tag(int stage, bool shape) { return (1 << 29) + 2 * stage + (shape ? 1 : 0); }

constexpr int kMaxDims = 8;

}  // namespace

at::Tensor empty_description() { return at::empty({kMaxDims + 1}, at::kLong); }

at::Tensor describe(const at::Tensor& t) {
  HP_CHECK(t.dim() <= kMaxDims, "pipeline: activations of more than ", kMaxDims, " dims");
  at::Tensor d = at::full({kMaxDims + 1}, -1, at::kLong);
  d[0] = static_cast<int64_t>(t.scalar_type());
  for (int64_t i = 0; i < t.dim(); ++i) d[i + 1] = t.size(i);
  return d;
}

at::Tensor empty_like_described(const at::Tensor& d, c10::Device device) {
  std::vector<int64_t> sizes;
  for (int64_t i = 1; i < d.numel() && d[i].item<int64_t>() >= 0; ++i) sizes.push_back(d[i].item<int64_t>());
  return at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(d[0].item<int64_t>())).device(device));
}

ActionKey action_key(const Action& a) { return std::make_tuple(static_cast<int>(a.kind), a.stage, a.micro_batch); }

namespace {

// The receive that takes the message of send action `a`, and the position it runs on.
std::pair<Action, int> receive_of_send(const Action& a, const std::vector<int>& stage_rank) {
  const bool forward = a.kind == ActionKind::kSendForward;
  const int to = forward ? a.stage + 1 : a.stage - 1;
  return {Action{forward ? ActionKind::kRecvForward : ActionKind::kRecvBackward, to, a.micro_batch}, stage_rank[to]};
}

bool is_send(const Action& a) { return a.kind == ActionKind::kSendForward || a.kind == ActionKind::kSendBackward; }

// Where each action stands in `program`.
std::map<ActionKey, int> indices(const std::vector<Action>& program) {
  std::map<ActionKey, int> at;
  for (size_t i = 0; i < program.size(); ++i) at.emplace(action_key(program[i]), static_cast<int>(i));
  return at;
}

int index_in(const std::map<ActionKey, int>& at, const Action& a) {
  const auto it = at.find(action_key(a));
  return it == at.end() ? -1 : it->second;
}

}  // namespace

std::vector<std::vector<Action>> sends_complete_after(const std::vector<std::vector<Action>>& programs,
                                                      const std::vector<int>& stage_rank, int position) {
  const std::vector<Action>& mine = programs[position];
  const auto my_index = indices(mine);
  // Per peer position: its actions' indices, and for each index j the first of this position's
  // actions that receives a message the peer posts at j or later (-1: none). One pass per peer.
  struct Peer {
    std::map<ActionKey, int> index;
    std::vector<int> first_answer;
  };
  std::map<int, Peer> peers;
  const auto peer = [&](int q) -> const Peer& {
    auto [it, fresh] = peers.try_emplace(q);
    if (!fresh) return it->second;
    const std::vector<Action>& theirs = programs[q];
    it->second.index = indices(theirs);
    std::vector<int>& first = it->second.first_answer;
    first.assign(theirs.size() + 1, -1);
    for (size_t j = theirs.size(); j-- > 0;) {
      first[j] = first[j + 1];
      if (!is_send(theirs[j])) continue;
      const auto [back, at] = receive_of_send(theirs[j], stage_rank);
      const int k = at == position ? index_in(my_index, back) : -1;
      if (k >= 0 && (first[j] < 0 || k < first[j])) first[j] = k;
    }
    return it->second;
  };
  std::vector<std::vector<Action>> complete(mine.size());
  for (const Action& sent : mine) {
    if (!is_send(sent)) continue;
    const auto [receive, q] = receive_of_send(sent, stage_rank);
    const Peer& p = peer(q);
    const int received = index_in(p.index, receive);
    if (received < 0) continue;  // a pass without that receive (forward only)
    // The first message back to this position that the peer posts after that receive.
    const int answered = p.first_answer[static_cast<size_t>(received) + 1];
    if (answered >= 0) complete[static_cast<size_t>(answered)].push_back(sent);
  }
  return complete;
}

StageMessages::StageMessages(comm::ProcessGroup group, std::shared_ptr<const StagePlacement> placement, int stages,
                             int micro_batches, bool dynamic_shapes)
    : group_(std::move(group)),
      placement_(std::move(placement)),
      micro_batches_(micro_batches),
      dynamic_shapes_(dynamic_shapes) {
  // Data tags stay below the dynamic-shape range, which stays below the shape range.
  HP_CHECK(stages >= 1 && stages < kMaxStages && micro_batches >= 1 &&
               static_cast<int64_t>(2 * kMaxStages) * (micro_batches + 1) < (int64_t{1} << 26),
           "pipeline: ", stages, " stages and ", micro_batches, " micro-batches are out of range (1 to ",
           kMaxStages - 1, " stages, 1 to ", (int64_t{1} << 26) / (2 * kMaxStages) - 2, " micro-batches)");
}

void StageMessages::begin_pass(c10::Device device) {
  device_ = device;
  sent_.clear();
  batched_receives_ = 0;
}

void StageMessages::send(const Action& action, int to_stage, const at::Tensor& tensor, int message_tag) {
  // Sends known to be complete (where the backend says so) release what they hold now.
  sends_.erase(std::remove_if(sends_.begin(), sends_.end(), [](const auto& s) { return s.second.is_completed(); }),
               sends_.end());
  const std::vector<int> targets = placement_->targets(placement_->position_of_stage(to_stage));
  for (int to : targets)
    sends_.emplace_back(targets.size() == 1 ? std::optional<ActionKey>(action_key(action)) : std::nullopt,
                        group_.send_async(tensor, to, message_tag));
}

void StageMessages::release(FailureNotice& notice, const Action& send) {
  const ActionKey k = action_key(send);
  for (auto it = sends_.begin(); it != sends_.end();) {
    if (it->first != k) {
      ++it;
      continue;
    }
    notice.wait(it->second);
    it = sends_.erase(it);
  }
}

void StageMessages::send_forward(int stage, int micro_batch, const at::Tensor& output) {
  std::vector<int64_t> sizes = output.sizes().vec();
  bool describe_now = dynamic_shapes_;
  if (!dynamic_shapes_) {
    const auto [sent, first] = sent_shape_.emplace(stage, std::make_pair(sizes, output.scalar_type()));
    HP_CHECK(sent->second.first == sizes && sent->second.second == output.scalar_type(), "the output changed from ",
             sent->second.second, " ", c10::IntArrayRef(sent->second.first), " to ", output.scalar_type(), " ",
             output.sizes(), "; set PipelineOptions::dynamic_shapes for shapes that change from step to step");
    describe_now = first;
  }
  const Action action{ActionKind::kSendForward, stage, micro_batch};
  if (describe_now)
    send(action, stage + 1, describe(output),
         dynamic_shapes_ ? dynamic_shape_tag(stage, micro_batch, micro_batches_) : shape_tag(stage));
  send(action, stage + 1, output, tag(false, stage, micro_batch, micro_batches_));
  sent_[{stage, micro_batch}] = {std::move(sizes), output.scalar_type()};
}

void StageMessages::send_backward(int stage, int micro_batch, const at::Tensor& grad_input) {
  send(Action{ActionKind::kSendBackward, stage, micro_batch}, stage - 1, grad_input,
       tag(true, stage, micro_batch, micro_batches_));
}

std::optional<StageMessages::Receive> StageMessages::known_receive(const Action& a) const {
  const int s = a.stage, mb = a.micro_batch;
  if (a.kind == ActionKind::kRecvForward) {
    const auto d = received_description_.find(s);
    if (dynamic_shapes_ || d == received_description_.end()) return std::nullopt;
    return Receive{placement_->source(placement_->position_of_stage(s - 1)), tag(false, s - 1, mb, micro_batches_),
                   empty_like_described(d->second, device_)};
  }
  const auto sent = sent_.find({s, mb});
  if (sent == sent_.end()) return std::nullopt;  // not sent forward yet
  return Receive{placement_->source(placement_->position_of_stage(s + 1)), tag(true, s + 1, mb, micro_batches_),
                 at::empty(sent->second.first, at::TensorOptions().dtype(sent->second.second).device(device_))};
}

void StageMessages::post_receives(const std::vector<Action>& program, size_t begin) {
  std::vector<comm::P2POp> ops;
  std::vector<std::pair<ActionKey, at::Tensor>> buffers;
  for (size_t i = begin; i < program.size() && !program[i].is_compute(); ++i) {
    const Action& a = program[i];
    if (a.kind != ActionKind::kRecvForward && a.kind != ActionKind::kRecvBackward) continue;
    if (posted_.count(action_key(a))) continue;
    if (std::optional<Receive> r = known_receive(a)) {
      ops.push_back(comm::P2POp::recv(r->buffer, r->from, r->tag));
      buffers.emplace_back(action_key(a), r->buffer);
    }
  }
  if (ops.empty()) return;
  std::vector<comm::Work> works = group_.batch_isend_irecv(ops);
  batched_receives_ += static_cast<int>(works.size());
  for (size_t k = 0; k < works.size(); ++k) posted_[buffers[k].first] = {buffers[k].second, std::move(works[k])};
}

at::Tensor StageMessages::receive(FailureNotice& notice, const Action& a) {
  if (const auto it = posted_.find(action_key(a)); it != posted_.end()) {
    Posted posted = std::move(it->second);
    posted_.erase(it);
    notice.wait(posted.work);
    return posted.buffer;
  }
  if (a.kind == ActionKind::kRecvForward && (dynamic_shapes_ || !received_description_.count(a.stage))) {
    // The shape first: once per stage boundary, or with every message when shapes may change.
    const int from = placement_->source(placement_->position_of_stage(a.stage - 1));
    const at::Tensor description = empty_description();
    notice.wait(group_.recv_async(
        description, from,
        dynamic_shapes_ ? dynamic_shape_tag(a.stage - 1, a.micro_batch, micro_batches_) : shape_tag(a.stage - 1)));
    if (dynamic_shapes_) {
      const at::Tensor buffer = empty_like_described(description, device_);
      notice.wait(group_.recv_async(buffer, from, tag(false, a.stage - 1, a.micro_batch, micro_batches_)));
      return buffer;
    }
    received_description_[a.stage] = description;
  }
  const std::optional<Receive> r = known_receive(a);
  HP_CHECK(r.has_value(), "pipeline: ", a.str(), " comes before its stage sent the activation it answers");
  notice.wait(group_.recv_async(r->buffer, r->from, r->tag));
  return r->buffer;
}

void StageMessages::finish_pass(FailureNotice& notice) {
  for (auto& [k, work] : sends_) notice.wait(work);
  sends_.clear();
}

void StageMessages::abandon() {
  for (auto& [k, work] : sends_) work.abort();
  for (auto& [k, posted] : posted_) posted.work.abort();
  sends_.clear();
  posted_.clear();
}

void StageMessages::send_inference(FailureNotice& notice, int stage, const at::Tensor& output) {
  for (int to : placement_->targets(placement_->position_of_stage(stage + 1))) {
    notice.wait(group_.send_async(describe(output), to, inference_tag(stage, true)));
    notice.wait(group_.send_async(output, to, inference_tag(stage, false)));
  }
}

at::Tensor StageMessages::receive_inference(FailureNotice& notice, int stage, c10::Device device) {
  const int from = placement_->source(placement_->position_of_stage(stage - 1));
  const at::Tensor description = empty_description();
  notice.wait(group_.recv_async(description, from, inference_tag(stage - 1, true)));
  const at::Tensor whole = empty_like_described(description, device);
  notice.wait(group_.recv_async(whole, from, inference_tag(stage - 1, false)));
  return whole;
}

}  // namespace hp::pp
