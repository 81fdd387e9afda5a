#include "hp/pp/executor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <set>
#include <utility>

#include "dtensor/dtensor_impl.h"
#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"
#include "pp/failure_notice.h"
#include "pp/placement.h"
#include "pp/weight_split.h"

namespace hp::pp {
namespace {

// Thrown through a pass when another rank's failure stopped this rank at `where`.
struct StoppedByPeer {
  std::string where;
};

// Message tags: one per (direction, stage, micro-batch), so messages match whatever order the
// programs post them in; shape messages have their own range.
int tag(bool backward, int stage, int micro_batch, int micro_batches) {
  return ((backward ? 1 : 0) * 4096 + stage) * (micro_batches + 1) + micro_batch + 1;
}
int shape_tag(int stage) { return (1 << 28) + stage; }
int dynamic_shape_tag(int stage, int micro_batch, int micro_batches) {
  return (1 << 27) + tag(false, stage, micro_batch, micro_batches);
}
int inference_tag(int stage, bool shape) { return (1 << 29) + 2 * stage + (shape ? 1 : 0); }
constexpr int kMaxDims = 8;

}  // namespace

// What a stage keeps of one micro-batch between its forward and its backward.
struct PipelineExecutor::Slot {
  at::Tensor input;        // stage > 0: a leaf that requires grad (its .grad is the gradient to send back)
  at::Tensor output;       // the stage's output, or the micro-batch's loss on the last stage
  at::Tensor grad_output;  // received gradient of the output (not on the last stage)
  at::Tensor grad_input;   // computed gradient of the input, to send back
  std::optional<std::vector<int64_t>> sent_sizes;  // of the whole output sent forward: its gradient comes back alike
  at::ScalarType sent_dtype = at::kFloat;
  std::shared_ptr<WeightGradientSplit> split;  // between I and W (set when the output depends on the input)
};

PipelineExecutor::PipelineExecutor(Schedule schedule, std::vector<PipelineStage> stages, comm::ProcessGroup group,
                                   LossFn loss, PipelineOptions options)
    : schedule_(std::move(schedule)),
      stages_(std::move(stages)),
      group_(std::move(group)),
      loss_(std::move(loss)),
      batch_p2p_(options.batch_p2p),
      batch_dim_(options.batch_dim),
      dynamic_shapes_(options.dynamic_shapes) {
  HP_CHECK(batch_dim_ >= 0, "PipelineExecutor: PipelineOptions::batch_dim must be >= 0, got ", batch_dim_);
  validate(schedule_);
  placement_ = std::make_shared<StagePlacement>(schedule_, std::move(options.position_ranks), group_);
  for (int s = 0; s < schedule_.stages; ++s) {
    const bool here = placement_->hosts(s);
    int found = 0;
    for (const auto& st : stages_) found += st.index == s;
    HP_CHECK(found == (here ? 1 : 0), "PipelineExecutor: rank ", group_.rank(), here ? " hosts" : " does not host",
             " stage ", s, " in schedule '", schedule_.name, "' but was given ", found, " module(s) for it");
    // Neighbouring stages on one position hand activations over in place, so their layouts must agree.
    if (here && s > 0 && placement_->hosts(s - 1))
      HP_CHECK(stage(s - 1).output_shard_dim == stage(s).input_shard_dim, "PipelineExecutor: stages ", s - 1,
               " and ", s, " run on the same ranks but stage ", s - 1, "'s output is sharded on dim ",
               stage(s - 1).output_shard_dim, " and stage ", s, "'s input on dim ", stage(s).input_shard_dim);
  }
  // Stage 0 splits I from W at the output of its first leaf module (the embedding, for split_llama):
  // its own input, tokens, has no gradient to end I at.
  if (placement_->hosts(0)) {
    for (const auto& [fqn, module] : stage(0).module->named_modules_fqn()) {
      if (!module->children().empty()) continue;
      first_leaf_output_ = std::make_shared<at::Tensor>();
      std::weak_ptr<at::Tensor> slot = first_leaf_output_;
      module->register_forward_hook([slot](nn::Module&, const nn::Inputs&, at::Tensor& output) {
        if (auto s = slot.lock(); s && at::GradMode::is_enabled() && output.requires_grad()) *s = output;
      });
      break;
    }
  }
  for (const TiedParameter& tie : options.tied) {
    // Copy j of a tied parameter lives on rank j of each position holding one of its stages.
    std::vector<int> world_ranks;
    std::set<int> positions;
    std::optional<at::Tensor> mine;
    for (int s : tie.stages) {
      HP_CHECK(s >= 0 && s < schedule_.stages, "PipelineExecutor: tied parameter '", tie.fqn, "' names stage ", s,
               " of a schedule with ", schedule_.stages, " stages");
      const int p = placement_->position_of_stage(s);
      HP_CHECK(positions.insert(p).second, "PipelineExecutor: tied parameter '", tie.fqn, "' has two stages on position ",
               p, "; stages sharing a rank would share one parameter, which is not supported yet");
      const std::vector<int>& ranks = placement_->ranks_of_position(p);
      HP_CHECK(ranks.size() == placement_->ranks_of_position(placement_->position()).size(),
               "PipelineExecutor: tied parameter '", tie.fqn, "' spans positions of different sizes");
      world_ranks.push_back(group_.ranks()[ranks[placement_->index_in_position()]]);
      if (placement_->hosts(s)) {
        bool found = false;
        for (const auto& item : stage(s).module->named_parameters())
          if (item.key() == tie.fqn) mine = item.value(), found = true;
        HP_CHECK(found, "PipelineExecutor: stage ", s, " has no parameter '", tie.fqn, "' to tie");
      }
    }
    if (mine && world_ranks.size() > 1)
      tied_.push_back({*mine, group_.new_group(world_ranks, "pp_tied")});
  }
}

void PipelineExecutor::sum_tied_gradients() {
  at::NoGradGuard no_grad;
  for (TiedCopy& tie : tied_) {
    at::Tensor grad = tie.param.grad();
    HP_CHECK(grad.defined(), "PipelineExecutor: the tied parameter has no gradient after the step");
    tie.group.all_reduce(detail::local_or_self(grad));  // in place: a DTensor gradient's local piece
  }
}

const PipelineStage& PipelineExecutor::stage(int index) const {
  for (const auto& s : stages_)
    if (s.index == index) return s;
  HP_FAIL("PipelineExecutor: no stage ", index, " on this rank");
}

namespace {

// A tensor's dtype and shape as a fixed-size int64 message, and back.
at::Tensor empty_description() { return at::empty({kMaxDims + 1}, at::kLong); }

at::Tensor describe(const at::Tensor& t) {
  HP_CHECK(t.dim() <= kMaxDims, "pipeline: activations of more than ", kMaxDims, " dims");
  at::Tensor d = at::full({kMaxDims + 1}, -1, at::kLong);
  d[0] = static_cast<int64_t>(t.scalar_type());
  for (int64_t i = 0; i < t.dim(); ++i) d[i + 1] = t.size(i);
  return d;
}

at::Tensor empty_like_described(const at::Tensor& d) {
  std::vector<int64_t> sizes;
  for (int64_t i = 1; i < d.numel() && d[i].item<int64_t>() >= 0; ++i) sizes.push_back(d[i].item<int64_t>());
  return at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(d[0].item<int64_t>())));
}

}  // namespace

at::Tensor PipelineExecutor::forward(const at::Tensor& inputs) {
  at::NoGradGuard no_grad;
  const int last = schedule_.stages - 1;
  const StagePlacement& place = *placement_;
  at::Tensor h;  // this rank's piece of the current stage's activation
  agree([&](FailureNotice& notice) {
    for (int s = 0; s <= last; ++s) {
      if (!place.hosts(s)) continue;
      const PipelineStage& st = stage(s);
      on_stage(notice, s, "the inference forward of stage " + std::to_string(s), [&] {
        if (s == 0) {
          h = inputs;
        } else if (!place.hosts(s - 1)) {  // the previous stage's output arrives with its shape
          const int from = place.source(place.position_of_stage(s - 1));
          const at::Tensor d = empty_description();
          notice.wait(group_.recv_async(d, from, inference_tag(s - 1, true)));
          const at::Tensor whole = empty_like_described(d);
          notice.wait(group_.recv_async(whole, from, inference_tag(s - 1, false)));
          h = place.piece(whole, st.input_shard_dim);
        }
        h = (*st.module)(h);
        if (s < last && !place.hosts(s + 1)) {
          const at::Tensor whole = place.whole(h, st.output_shard_dim);
          for (int to : place.targets(place.position_of_stage(s + 1))) {
            notice.wait(group_.send_async(describe(whole), to, inference_tag(s, true)));
            notice.wait(group_.send_async(whole, to, inference_tag(s, false)));
          }
        }
        if (s == last) {  // whole on the position's first rank, which broadcasts it
          h = place.whole(h, st.output_shard_dim);
          if (is_dtensor(h)) h = DTensor(h).full_tensor();  // e.g. vocabulary-sharded logits (loss parallel)
        }
      });
    }
    return 0.0;
  });
  // Every rank gets the last stage's output, from the first rank of its position.
  const int owner = place.first_rank_of_stage(last);
  const bool mine = owner == group_.rank();
  at::Tensor d = mine ? describe(h) : empty_description();
  group_.broadcast(d, owner);
  at::Tensor out = mine ? h.contiguous() : empty_like_described(d);
  group_.broadcast(out, owner);
  return out;
}

Simulation PipelineExecutor::measured_step() const {
  // Each position's first rank contributes its actions as rows of [kind, stage, micro-batch,
  // position, start, end]; everyone gathers all of them.
  constexpr int64_t kFields = 6;
  at::Tensor mine = at::empty({0, kFields}, at::kDouble);
  if (placement_->is_position_leader() && !timeline_.empty()) {
    std::vector<double> rows;
    for (const TimedAction& t : timeline_)
      rows.insert(rows.end(), {static_cast<double>(t.action.kind), static_cast<double>(t.action.stage),
                               static_cast<double>(t.action.micro_batch), static_cast<double>(t.rank), t.start, t.end});
    mine = at::tensor(rows, at::kDouble).view({-1, kFields});
  }
  const at::Tensor counts = group_.all_gather(at::tensor({mine.size(0)}, at::kLong));
  comm::AllGatherOptions options;
  options.sizes.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + counts.numel());
  const at::Tensor all = group_.all_gather(mine, options);
  std::vector<TimedAction> timeline;
  const auto a = all.accessor<double, 2>();
  for (int64_t i = 0; i < all.size(0); ++i)
    timeline.push_back({Action{static_cast<ActionKind>(static_cast<int>(a[i][0])), static_cast<int>(a[i][1]),
                               static_cast<int>(a[i][2])},
                        static_cast<int>(a[i][3]), a[i][4], a[i][5]});
  return measured(std::move(timeline), schedule_.ranks);
}

int PipelineExecutor::peak_live_micro_batches(int stage) const {
  const auto it = peak_live_.find(stage);
  return it == peak_live_.end() ? 0 : it->second;
}

double PipelineExecutor::step(const at::Tensor& inputs, const at::Tensor& targets) {
  const double loss = run(inputs, targets, /*backward=*/true);
  sum_tied_gradients();
  return loss;
}

double PipelineExecutor::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  at::NoGradGuard no_grad;
  return run(inputs, targets, /*backward=*/false);
}

double PipelineExecutor::run(const at::Tensor& inputs, const at::Tensor& targets, bool backward) {
  const int m = schedule_.micro_batches, last = schedule_.stages - 1;
  const int64_t d = batch_dim_;
  HP_CHECK(inputs.dim() > d && targets.dim() > d, "PipelineExecutor: micro-batches split dim ", d,
           " (PipelineOptions::batch_dim), but the inputs have ", inputs.dim(), " dims and the targets ", targets.dim());
  HP_CHECK(inputs.size(d) % m == 0 && targets.size(d) == inputs.size(d), "PipelineExecutor: a batch of ",
           inputs.size(d), " along dim ", d, " does not split into ", m, " micro-batches (targets: ", targets.size(d),
           ")");
  const std::vector<at::Tensor> xs = inputs.chunk(m, d), ys = targets.chunk(m, d);
  std::map<std::pair<int, int>, Slot> slots;
  std::map<int, int> live;
  peak_live_.clear();
  split_weight_actions_ = 0;
  batched_receives_ = 0;
  double loss_sum = 0.0;
  timeline_.clear();
  const auto now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  const StagePlacement& place = *placement_;
  const auto position = [&](int s) { return place.position_of_stage(s); };

  // The actions of this pass. Forward only: the forward actions in program order (a valid
  // schedule's forward subsequence is valid: backward actions never produce what a forward waits for).
  std::vector<Action> program;
  for (const Action& a : schedule_.programs[place.position()])
    if (backward || a.kind == ActionKind::kForward || a.kind == ActionKind::kSendForward ||
        a.kind == ActionKind::kRecvForward)
      program.push_back(a);

  // Where a receive action's message comes from, with its tag and a buffer for it; nullopt while
  // its shape is unknown (the first step, before the shape has crossed).
  struct Receive {
    int from, tag;
    at::Tensor buffer;
  };
  const auto receive_of = [&](const Action& a) -> std::optional<Receive> {
    const int s = a.stage, mb = a.micro_batch;
    if (a.kind == ActionKind::kRecvForward) {
      const auto d = received_description_.find(s);
      if (dynamic_shapes_ || d == received_description_.end()) return std::nullopt;
      return Receive{place.source(position(s - 1)), tag(false, s - 1, mb, m), empty_like_described(d->second)};
    }
    const auto slot = slots.find({s, mb});
    if (slot == slots.end() || !slot->second.sent_sizes) return std::nullopt;  // not sent forward yet
    return Receive{place.source(position(s + 1)), tag(true, s + 1, mb, m),
                   at::empty(*slot->second.sent_sizes, at::TensorOptions().dtype(slot->second.sent_dtype))};
  };
  const auto key = [](const Action& a) { return std::make_tuple(static_cast<int>(a.kind), a.stage, a.micro_batch); };
  // Batched P2P: posts, as one batch, the receives of the run of communication actions at `begin`.
  const auto post_receives = [&](size_t begin) {
    std::vector<comm::P2POp> ops;
    std::vector<std::pair<std::tuple<int, int, int>, at::Tensor>> posted;
    for (size_t j = begin; j < program.size() && !program[j].is_compute(); ++j) {
      const Action& r = program[j];
      if (r.kind != ActionKind::kRecvForward && r.kind != ActionKind::kRecvBackward) continue;
      if (posted_receives_.count(key(r))) continue;
      if (std::optional<Receive> receive = receive_of(r)) {
        ops.push_back(comm::P2POp::recv(receive->buffer, receive->from, receive->tag));
        posted.emplace_back(key(r), receive->buffer);
      }
    }
    if (ops.empty()) return;
    std::vector<comm::Work> works = group_.batch_isend_irecv(ops);
    batched_receives_ += static_cast<int>(works.size());
    for (size_t k = 0; k < works.size(); ++k)
      posted_receives_[posted[k].first] = {posted[k].second, std::move(works[k])};
  };
  // The message of receive action `a`: waited where the batch posted it, or received now.
  const auto receive = [&](FailureNotice& notice, const Action& a) {
    const auto it = posted_receives_.find(key(a));
    if (it != posted_receives_.end()) {
      PostedReceive posted = std::move(it->second);
      posted_receives_.erase(it);
      notice.wait(posted.work);
      return posted.buffer;
    }
    if (a.kind == ActionKind::kRecvForward && (dynamic_shapes_ || !received_description_.count(a.stage))) {
      // The shape first: once per stage boundary, or with every message when shapes may change.
      const int from = place.source(position(a.stage - 1));
      at::Tensor description = empty_description();
      notice.wait(group_.recv_async(description, from,
                                    dynamic_shapes_ ? dynamic_shape_tag(a.stage - 1, a.micro_batch, m) : shape_tag(a.stage - 1)));
      if (dynamic_shapes_) {
        const at::Tensor buffer = empty_like_described(description);
        notice.wait(group_.recv_async(buffer, from, tag(false, a.stage - 1, a.micro_batch, m)));
        return buffer;
      }
      received_description_[a.stage] = description;
    }
    const Receive r = *receive_of(a);
    notice.wait(group_.recv_async(r.buffer, r.from, r.tag));
    return r.buffer;
  };

  // The mean loss lives on the last stage's rank; agree() sums it over ranks.
  return agree([&](FailureNotice& notice) {
    std::vector<comm::Work>& sends = pending_sends_;
    for (size_t i = 0; i < program.size(); ++i) {
      const Action& a = program[i];
      if (batch_p2p_ && (a.is_compute() || i == 0 || program[i - 1].is_compute()))
        on_stage(notice, -1, "posting the receives after " + a.str(), [&] {
          post_receives(a.is_compute() ? i + 1 : i);  // the next run's, or this run's
        });
      const int s = a.stage, mb = a.micro_batch;
      Slot& slot = slots[{s, mb}];
      const double started = record_ ? now() : 0.0;
      on_stage(notice, s, a.str() + " of schedule '" + schedule_.name + "'", [&] {
        switch (a.kind) {
          case ActionKind::kForward: {
            at::Tensor in = s == 0 ? xs[mb] : slot.input;
            if (s > 0 && !in.defined()) {  // the previous stage is on this rank
              Slot& previous = slots.at({s - 1, mb});
              in = previous.output.detach().requires_grad_(backward);
              if (!backward) previous.output = at::Tensor();  // nothing keeps activations without backward
              slot.input = in;
            }
            at::Tensor out = (*stage(s).module)(in);
            if (s == 0 && first_leaf_output_ && first_leaf_output_->defined())
              slot.input = std::exchange(*first_leaf_output_, at::Tensor());
            if (s == last) {
              out = loss_(out, ys[mb]) / static_cast<double>(m);
              // Every rank of the last position computes the loss; its first reports it.
              if (place.is_position_leader()) loss_sum += out.detach().item<double>();
            }
            slot.output = out;
            peak_live_[s] = std::max(peak_live_[s], ++live[s]);
            break;
          }
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput: {
            at::Tensor grad = slot.grad_output;
            if (s < last && !grad.defined()) {  // the next stage is on this rank
              Slot& next = slots.at({s + 1, mb});
              grad = next.grad_input;
              next.grad_input = at::Tensor();
            }
            HP_CHECK(s == last || grad.defined(), "no gradient for the output");
            const std::vector<at::Tensor> outputs = {slot.output}, grads = s == last ? std::vector<at::Tensor>{}
                                                                                     : std::vector<at::Tensor>{grad};
            if (a.kind == ActionKind::kBackward) {
              torch::autograd::backward(outputs, grads);
              const at::Tensor grad_input = s > 0 ? slot.input.grad() : at::Tensor();
              slot = Slot{};
              slot.grad_input = grad_input;  // kept until sent (or read by the previous stage here)
              --live[s];
            } else {
              // dx now, keeping the graph for W. Stage 0's input (tokens) has no gradient: its I ends
              // at the stand-in (see first_leaf_output_) and sends nothing; without one, W does it all.
              if (slot.input.defined()) {
                slot.split = WeightGradientSplit::prepare(slot.output, slot.input, stage(s).module->parameters());
                slot.grad_input = slot.split ? slot.split->input_gradient(slot.output, slot.input, grad)
                                             : torch::autograd::grad(outputs, {slot.input}, grads, /*retain_graph=*/true)[0];
                if (s == 0) slot.grad_input = at::Tensor();
              }
              slot.grad_output = grad;
            }
            break;
          }
          case ActionKind::kBackwardWeight: {
            // dw: from where the parameters' branches left the I path (WeightGradientSplit), or, on a
            // stage without an input gradient (stage 0), by walking the stage's graph once more.
            if (slot.split) {
              slot.split->weight_gradients();
              ++split_weight_actions_;
            } else {
              const std::vector<at::Tensor> grads =
                  s == last ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{slot.grad_output};
              torch::autograd::backward({slot.output}, grads, /*retain_graph=*/false, /*create_graph=*/false,
                                        stage(s).module->parameters());
            }
            const at::Tensor grad_input = slot.grad_input;
            slot = Slot{};
            slot.grad_input = grad_input;
            --live[s];
            break;
          }
          case ActionKind::kSendForward: {
            const at::Tensor out = place.whole(slot.output.detach(), stage(s).output_shard_dim);
            slot.sent_sizes = out.sizes().vec();
            slot.sent_dtype = out.scalar_type();
            // The shape travels once per stage boundary, or with every message when shapes may change.
            bool describe_now = dynamic_shapes_;
            if (!dynamic_shapes_) {
              const auto [sent, first] = sent_shape_.emplace(s, *slot.sent_sizes);
              HP_CHECK(sent->second == *slot.sent_sizes, "the output shape changed from ", c10::IntArrayRef(sent->second),
                       " to ", out.sizes(), "; set PipelineOptions::dynamic_shapes for shapes that change from step to "
                       "step or between micro-batches");
              describe_now = first;
            }
            for (int to : place.targets(position(s + 1))) {
              if (describe_now)
                sends.push_back(group_.send_async(describe(out), to,
                                                  dynamic_shapes_ ? dynamic_shape_tag(s, mb, m) : shape_tag(s)));
              sends.push_back(group_.send_async(out, to, tag(false, s, mb, m)));
            }
            if (!backward) slot.output = at::Tensor();  // the sends hold `out` until they complete
            break;
          }
          case ActionKind::kRecvForward: {
            slot.input = place.piece(receive(notice, a), stage(s).input_shard_dim).requires_grad_(backward);
            break;
          }
          case ActionKind::kSendBackward: {
            const at::Tensor grad = place.whole(slot.grad_input, stage(s).input_shard_dim);
            for (int to : place.targets(position(s - 1))) sends.push_back(group_.send_async(grad, to, tag(true, s, mb, m)));
            slot.grad_input = at::Tensor();  // the sends hold it until they complete
            break;
          }
          case ActionKind::kRecvBackward: {
            // The gradient of the whole output (whose shape the forward send recorded), then this rank's piece.
            slot.grad_output = place.piece(receive(notice, a), stage(s).output_shard_dim);
            break;
          }
        }
      });
      if (record_) timeline_.push_back({a, place.position(), started, now()});
      // Completed sends release what they hold now, not at the end of the step.
      sends.erase(std::remove_if(sends.begin(), sends.end(), [](const comm::Work& w) { return w.is_completed(); }),
                  sends.end());
    }
    on_stage(notice, -1, "the end of the step", [&] {
      for (auto& w : sends) notice.wait(w);
    });
    sends.clear();
    return loss_sum;
  });
}

// Runs one action of `stage` (-1: of no stage in particular). A failure that comes from another rank's
// published failure (an aborted wait) is reported as such; this rank's own failure names its stage.
void PipelineExecutor::on_stage(FailureNotice& notice, int stage, const std::string& where,
                                const std::function<void()>& action) {
  try {
    action();
  } catch (const std::exception& e) {
    if (notice.failed()) throw StoppedByPeer{where};
    if (stage < 0) HP_FAIL("pipeline rank ", group_.rank(), " failed at ", where, ": ", e.what());
    HP_FAIL("pipeline stage ", stage, " (rank ", group_.rank(), ") failed at ", where, ": ", e.what());
  }
  if (notice.failed()) throw StoppedByPeer{where};  // no need to run on: the step has failed
}

double PipelineExecutor::agree(const std::function<double(FailureNotice&)>& pass) {
  HP_CHECK(!broken_, "PipelineExecutor: an earlier pass failed (", broken_reason_,
           "); the pipeline's ranks are out of step, so this executor cannot run again");
  FailureNotice notice(group_, "hp_pp/failure/" + std::to_string(passes_++));
  double value = 0.0;
  std::string own_failure, stopped_at;
  try {
    value = pass(notice);
  } catch (const StoppedByPeer& stopped) {
    stopped_at = stopped.where;
  } catch (const std::exception& e) {
    own_failure = e.what();
    notice.publish(own_failure);
  }
  notice.stop();
  if (!own_failure.empty() || !stopped_at.empty()) {
    // Messages whose peers stopped may never come; the group keeps their buffers.
    for (comm::Work& w : pending_sends_) w.abort();
    for (auto& [key, posted] : posted_receives_) posted.work.abort();
  }
  pending_sends_.clear();
  posted_receives_.clear();
  // Every rank reaches this collective, whether its part of the pass succeeded or not.
  at::Tensor outcome = at::tensor({value, own_failure.empty() ? 0.0 : 1.0}, at::kDouble);
  group_.all_reduce(outcome);
  if (outcome[1].item<double>() == 0.0) return outcome[0].item<double>();
  broken_ = true;
  if (!own_failure.empty()) {
    broken_reason_ = own_failure;
    HP_FAIL(own_failure);
  }
  broken_reason_ = notice.message();
  HP_FAIL(broken_reason_, "; so rank ", group_.rank(), " stopped ",
          stopped_at.empty() ? std::string("after its last action") : "at " + stopped_at);
}

}  // namespace hp::pp
