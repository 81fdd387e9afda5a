#include "hp/pp/executor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "hp/comm/leave.h"
#include "hp/core/error.h"
#include "hp/core/step_phase.h"
#include "hp/core/weight_split.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"
#include "hp/nn/token_coordinates.h"
#include "pp/failure_notice.h"
#include "pp/messages.h"
#include "pp/placement.h"

namespace hp::pp {
namespace {

// Thrown through a pass when another rank's failure stopped this rank at `where`.
struct StoppedByPeer {
  std::string where;
};

}  // namespace

// What a stage keeps of one micro-batch between its forward and its backward.
struct PipelineExecutor::Slot {
  at::Tensor input;        // stage > 0: a leaf that requires grad (its .grad is the gradient to send back)
  at::Tensor output;       // the stage's output, or the micro-batch's loss on the last stage
  at::Tensor grad_output;  // received gradient of the output (not on the last stage)
  at::Tensor grad_input;   // computed gradient of the input, to send back
  std::shared_ptr<WeightGradientSplit> split;  // between I and W (set when the output depends on the input)
};

PipelineExecutor::PipelineExecutor(Schedule schedule, std::vector<PipelineStage> stages, comm::ProcessGroup group,
                                   LossFn loss, PipelineOptions options)
    : schedule_(std::move(schedule)),
      stages_(std::move(stages)),
      group_(std::move(group)),
      loss_(std::move(loss)),
      batch_p2p_(options.batch_p2p),
      batch_dim_(options.batch_dim) {
  HP_CHECK(batch_dim_ >= 0, "PipelineExecutor: PipelineOptions::batch_dim must be >= 0, got ", batch_dim_);
  HP_CHECK(schedule_.stages >= 1 && schedule_.micro_batches >= 1 && schedule_.ranks >= 1,
           "PipelineExecutor: schedule '", schedule_.name, "' has ", schedule_.ranks, " ranks, ", schedule_.stages,
           " stages and ", schedule_.micro_batches, " micro-batches; it needs at least one of each");
  validate(schedule_);
  placement_ = std::make_shared<StagePlacement>(schedule_, std::move(options.position_ranks), group_);
  messages_ = std::make_shared<StageMessages>(group_, placement_, schedule_.stages, schedule_.micro_batches,
                                              options.dynamic_shapes);
  for (int s = 0; s < schedule_.stages; ++s) {
    const bool here = placement_->hosts(s);
    int found = 0;
    for (const auto& st : stages_) found += st.index == s;
    HP_CHECK(found == (here ? 1 : 0), "PipelineExecutor: rank ", group_.rank(), here ? " hosts" : " does not host",
             " stage ", s, " in schedule '", schedule_.name, "' but was given ", found, " module(s) for it");
    // Neighbouring stages on one position hand activations over in place, so their layouts must agree.
    if (here && s > 0 && placement_->hosts(s - 1))
      HP_CHECK(stage(s - 1).output_shard_dim == stage(s).input_shard_dim, "PipelineExecutor: stages ", s - 1, " and ",
               s, " run on the same ranks but stage ", s - 1, "'s output is sharded on dim ",
               stage(s - 1).output_shard_dim, " and stage ", s, "'s input on dim ", stage(s).input_shard_dim);
  }
  // Stage 0 splits I from W at the output of its first leaf module (the embedding, for split_llama):
  // its own input, tokens, has no gradient to end I at.
  if (placement_->hosts(0)) {
    for (const auto& [fqn, module] : stage(0).module->named_modules_fqn()) {
      if (!module->children().empty()) continue;
      first_leaf_output_ = std::make_shared<StandIn>();
      std::weak_ptr<StandIn> slot = first_leaf_output_;
      module->register_forward_hook([slot](nn::Module&, const nn::Inputs&, at::Tensor& output) {
        // Only during the executor's forward of stage 0, and only an output computed here (a leaf,
        // such as a parameter returned as is, has no node for W to go on from).
        if (auto s = slot.lock(); s && s->armed && output.requires_grad() && output.grad_fn()) s->output = output;
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
      HP_CHECK(positions.insert(p).second, "PipelineExecutor: tied parameter '", tie.fqn,
               "' has two stages on position ", p,
               "; stages sharing a rank would share one parameter, which is not supported yet");
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
    if (mine && world_ranks.size() > 1) tied_.push_back({*mine, group_.new_group(world_ranks, "pp_tied")});
  }
}

void PipelineExecutor::sum_tied_gradients() {
  at::NoGradGuard no_grad;
  for (TiedCopy& tie : tied_) {
    at::Tensor grad = tie.param.grad();
    HP_CHECK(grad.defined(), "PipelineExecutor: the tied parameter has no gradient after the step");
    tie.group.all_reduce(local_tensor(grad));  // in place: a DTensor gradient's local piece
  }
}

const PipelineStage& PipelineExecutor::stage(int index) const {
  for (const auto& s : stages_)
    if (s.index == index) return s;
  HP_FAIL("PipelineExecutor: no stage ", index, " on this rank");
}

at::Tensor PipelineExecutor::forward(const at::Tensor& inputs) {
  at::NoGradGuard no_grad;
  const int last = schedule_.stages - 1;
  const StagePlacement& place = *placement_;
  at::Tensor h;  // this rank's piece of the current stage's activation
  agree([&](FailureNotice& notice) {
    for (int s = 0; s <= last; ++s) {
      if (!place.hosts(s)) continue;
      const PipelineStage& st = stage(s);
      on_stage(
          notice, s, [s] { return "the inference forward of stage " + std::to_string(s); },
          [&] {
            if (s == 0) {
              h = inputs;
            } else if (!place.hosts(s - 1)) {  // the previous stage's output arrives with its shape
              h = place.piece(messages_->receive_inference(notice, s, inputs.device()), st.input_shard_dim);
            }
            h = (*st.module)(h);
            if (s < last && !place.hosts(s + 1))
              messages_->send_inference(notice, s, place.whole(h, st.output_shard_dim));
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
  at::Tensor out = mine ? h.contiguous() : empty_like_described(d, inputs.device());
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

void PipelineExecutor::reschedule(Schedule schedule) {
  HP_CHECK(!broken_, "PipelineExecutor::reschedule after a failed step: ", broken_reason_);
  HP_CHECK(schedule.ranks == schedule_.ranks && schedule.stages == schedule_.stages &&
               schedule.micro_batches == schedule_.micro_batches && schedule.stage_rank == schedule_.stage_rank,
           "PipelineExecutor::reschedule: schedule '", schedule.name, "' (", schedule.ranks, " ranks, ",
           schedule.stages, " stages, ", schedule.micro_batches, " micro-batches) does not place the stages of '",
           schedule_.name, "' (", schedule_.ranks, ", ", schedule_.stages, ", ", schedule_.micro_batches,
           ") on the same ranks");
  validate(schedule);
  schedule_ = std::move(schedule);
  pass_programs_.clear();
}

int PipelineExecutor::batched_receives() const { return messages_->batched_receives(); }

const PipelineExecutor::PassPrograms& PipelineExecutor::pass_programs(bool backward) {
  auto [it, first] = pass_programs_.try_emplace(backward);
  if (!first) return it->second;
  // Forward only: the forward actions in program order (a valid schedule's forward subsequence is
  // valid: backward actions never produce what a forward waits for).
  for (const std::vector<Action>& all : schedule_.programs) {
    std::vector<Action>& program = it->second.programs.emplace_back();
    for (const Action& a : all)
      if (backward || a.kind == ActionKind::kForward || a.kind == ActionKind::kSendForward ||
          a.kind == ActionKind::kRecvForward)
        program.push_back(a);
  }
  it->second.sends_complete_after =
      sends_complete_after(it->second.programs, schedule_.stage_rank, placement_->position());
  return it->second;
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
           " (PipelineOptions::batch_dim), but the inputs have ", inputs.dim(), " dims and the targets ",
           targets.dim());
  HP_CHECK(inputs.size(d) % m == 0 && targets.size(d) == inputs.size(d), "PipelineExecutor: a batch of ",
           inputs.size(d), " along dim ", d, " does not split into ", m, " micro-batches (targets: ", targets.size(d),
           ")");
  const std::vector<at::Tensor> xs = inputs.chunk(m, d), ys = targets.chunk(m, d);
  std::map<std::pair<int, int>, Slot> slots;
  std::map<int, int> live;
  peak_live_.clear();
  split_weight_actions_ = 0;
  messages_->begin_pass(inputs.device());
  double loss_sum = 0.0;
  timeline_.clear();
  const auto now = [] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  };
  const StagePlacement& place = *placement_;

  const std::vector<Action>& program = pass_programs(backward).programs[place.position()];
  const std::vector<std::vector<Action>>& releases = pass_programs(backward).sends_complete_after;

  // The mean loss lives on the last stage's rank; agree() sums it over ranks.
  return agree([&](FailureNotice& notice) {
    for (size_t i = 0; i < program.size(); ++i) {
      const Action& a = program[i];
      // Batched P2P: a run of communication actions posts its receives together, one computation
      // ahead (while the computation before the run), or at its start when that is the pass's start.
      if (batch_p2p_ && (a.is_compute() || i == 0))
        on_stage(
            notice, -1, [&] { return "posting the receives after " + a.str(); },
            [&] { messages_->post_receives(program, a.is_compute() ? i + 1 : i); });
      const int s = a.stage, mb = a.micro_batch;
      Slot& slot = slots[{s, mb}];
      const double started = record_ ? now() : 0.0;
      std::optional<StepPhaseScope> phase;  // for the cost model's recorders
      if (a.is_compute()) phase.emplace(a.kind == ActionKind::kForward ? StepPhase::kForward : StepPhase::kBackward);
      on_stage(
          notice, s, [&] { return a.str() + " of schedule '" + schedule_.name + "'"; },
          [&] {
            switch (a.kind) {
              case ActionKind::kForward: {
                at::Tensor in = s == 0 ? xs[mb] : slot.input;
                if (s > 0 && !in.defined()) {  // the previous stage is on this rank
                  Slot& previous = slots.at({s - 1, mb});
                  in = previous.output.detach().requires_grad_(backward);
                  if (!backward) previous.output = at::Tensor();  // nothing keeps activations without backward
                  slot.input = in;
                }
                const bool stand_in = s == 0 && backward && first_leaf_output_;
                if (stand_in) first_leaf_output_->armed = true;
                // Draws by global position (dropout) see this micro-batch's rows of the call's.
                HP_CHECK(d == 0 || nn::token_coordinates() == nullptr, "PipelineExecutor: token coordinates (for ",
                         "draws by global position, such as dropout) describe rows along dim 0, but micro-batches ",
                         "split dim ", d);
                std::optional<nn::MicroBatchRows> rows;
                if (d == 0) rows.emplace(mb * xs[0].size(0));
                at::Tensor out = (*stage(s).module)(in);
                rows.reset();
                if (stand_in) {
                  first_leaf_output_->armed = false;
                  slot.input = std::exchange(first_leaf_output_->output, at::Tensor());
                }
                if (s == last) {
                  out = loss_(out, ys[mb]) / static_cast<double>(m);
                  // Every rank of the last position computes the loss; its first reports it.
                  // (A dry run's loss on the meta device has no value.)
                  if (place.is_position_leader())
                    loss_sum += out.is_meta() ? std::numeric_limits<double>::quiet_NaN() : out.detach().item<double>();
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
                const std::vector<at::Tensor> outputs = {slot.output}, grads = s == last
                                                                                   ? std::vector<at::Tensor>{}
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
                    if (slot.split)
                      slot.grad_input = slot.split->input_gradient(slot.output, slot.input, grad);
                    else if (s > 0)
                      slot.grad_input = torch::autograd::grad(outputs, {slot.input}, grads, /*retain_graph=*/true)[0];
                    if (s == 0) slot.grad_input = at::Tensor();  // stage 0 sends nothing back
                  }
                  // The plain W starts from the output's gradient; the split has what it needs recorded.
                  slot.grad_output = slot.split ? at::Tensor() : grad;
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
                messages_->send_forward(s, mb, place.whole(slot.output.detach(), stage(s).output_shard_dim));
                if (!backward) slot.output = at::Tensor();  // the sends hold it until they complete
                break;
              }
              case ActionKind::kRecvForward: {
                slot.input =
                    place.piece(messages_->receive(notice, a), stage(s).input_shard_dim).requires_grad_(backward);
                break;
              }
              case ActionKind::kSendBackward: {
                messages_->send_backward(s, mb, place.whole(slot.grad_input, stage(s).input_shard_dim));
                slot.grad_input = at::Tensor();  // the sends hold it until they complete
                break;
              }
              case ActionKind::kRecvBackward: {
                // The gradient of the whole output (whose shape the forward send recorded), then this rank's piece.
                slot.grad_output = place.piece(messages_->receive(notice, a), stage(s).output_shard_dim);
                break;
              }
            }
            for (const Action& send : releases[i]) messages_->release(notice, send);  // its buffer can go
          });
      if (record_) timeline_.push_back({a, place.position(), started, now()});
    }
    on_stage(
        notice, -1, [] { return std::string("the end of the step"); }, [&] { messages_->finish_pass(notice); });
    return loss_sum;
  });
}

// Runs one action of `stage` (-1: of no stage in particular). A failure that comes from another rank's
// published failure (an aborted wait) is reported as such; this rank's own failure names its stage.
void PipelineExecutor::on_stage(FailureNotice& notice, int stage, const std::function<std::string()>& where,
                                const std::function<void()>& action) {
  try {
    action();
  } catch (const std::exception& e) {
    if (notice.failed()) throw StoppedByPeer{where()};
    if (stage < 0) HP_FAIL("pipeline rank ", group_.rank(), " failed at ", where(), ": ", e.what());
    HP_FAIL("pipeline stage ", stage, " (rank ", group_.rank(), ") failed at ", where(), ": ", e.what());
  }
  if (notice.failed()) throw StoppedByPeer{where()};  // no need to run on: the step has failed
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
  if (!own_failure.empty() || !stopped_at.empty()) messages_->abandon();
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
  comm::note_failure_of_another_rank(group_);
  HP_FAIL(broken_reason_, "; so rank ", group_.rank(), " stopped ",
          stopped_at.empty() ? std::string("after its last action") : "at " + stopped_at);
}

}  // namespace hp::pp
