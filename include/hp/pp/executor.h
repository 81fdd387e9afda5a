// Running a pipeline schedule: each rank executes its program of actions on the stages it hosts,
// with activations and gradients passed by point-to-point messages between stage ranks.
//
//   auto stages = hp::models::split_llama(model, {2, 2});        // stage modules (layer ranges)
//   hp::pp::PipelineExecutor pipe(hp::pp::one_f_one_b(2, 4), {{stages[rank], rank}}, world, loss_fn);
//   double loss = pipe.step(tokens, targets);                    // forward + backward of one batch
//   optimizer.step();                                            // each rank steps its stages' parameters
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/nn/module.h"
#include "hp/pp/schedule.h"

namespace hp::pp {

class FailureNotice;
class StageMessages;
class StagePlacement;

// The loss of one micro-batch from the last stage's output and the micro-batch's targets.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

struct PipelineStage {
  std::shared_ptr<nn::Module> module;
  int index;  // stage index in the schedule
  // When the stage runs on several ranks (MPMD, below): the dim its input / its output is sharded
  // on over those ranks (sequence parallel: 1), or -1 when each of them holds it whole (TP without
  // SP). Activations cross between stages whole and are cut to this layout on arrival.
  int64_t input_shard_dim = -1;
  int64_t output_shard_dim = -1;
};

// One parameter that several stages share (tied embeddings: the first stage's embedding and the
// last stage's head). Each of those stages holds its own copy under the same FQN, starting equal;
// after every step the executor sums the copies' gradients over the ranks holding them, so the same
// optimizer update keeps them equal.
struct TiedParameter {
  std::string fqn;          // within each stage module, e.g. "embed.weight"
  std::vector<int> stages;  // on different positions
};

struct PipelineOptions {
  // MPMD stage meshes: position_ranks[p] lists the group ranks that run position p of the schedule
  // (the schedule's rank p: programs[p] and its stages), e.g. {{0}, {1, 2}} runs stage 0 on rank 0
  // alone and stage 1 on ranks 1 and 2, which hold it tensor-parallel. Every rank of a position runs
  // its program; the loss is reported by its first rank. Empty: group rank p runs position p.
  std::vector<std::vector<int>> position_ranks;
  std::vector<TiedParameter> tied;
  // Batched P2P: the receives of each run of communication actions (those between two
  // computations) are posted together as one batch, and before the computation that precedes
  // them, so their messages arrive while it runs (Megatron's overlap_p2p_comm). Off: each receive
  // is posted when its action runs and waited at once. Either way a receive is waited where its
  // action stands, so the validator's deadlock proof holds for both.
  bool batch_p2p = true;
  // The dim of step()'s inputs and targets that micro-batches split (e.g. 1 for [seq, batch]).
  int64_t batch_dim = 0;
  // Shapes that change from step to step or between micro-batches (e.g. packed sequences of varying
  // length): each activation travels with its shape, and receives of activations are not posted
  // ahead. Off: the shape crosses each stage boundary once, and a change is a clear error.
  bool dynamic_shapes = false;
};

class PipelineExecutor {
 public:
  // `stages`: the stages this rank hosts (schedule.stage_rank says which). `group`: the pipeline's
  // ranks; group rank r runs schedule.programs[r] unless options place positions otherwise. Give
  // the executor a group of its own (as new_group does): an asynchronous collective of the caller's
  // still in flight on it when a pass starts would hold the pass's messages behind it.
  // Validates the schedule and the placement.
  PipelineExecutor(Schedule schedule, std::vector<PipelineStage> stages, comm::ProcessGroup group, LossFn loss,
                   PipelineOptions options = {});

  // One forward and backward of the whole batch: `inputs` and `targets` (the same on every rank;
  // stage 0 reads inputs, the last stage targets) are split into the schedule's micro-batches along
  // PipelineOptions::batch_dim (0 by default). Activation shapes cross each stage boundary on the
  // first step, and later steps must keep them (checked), unless PipelineOptions::dynamic_shapes.
  // Gradients accumulate into the stages' parameters as for one backward of the mean loss over
  // micro-batches. Returns that mean loss on every rank. Collective over `group`.
  double step(const at::Tensor& inputs, const at::Tensor& targets);

  // Forward only, without autograd: the mean loss over the micro-batches, on every rank. Collective.
  double evaluate(const at::Tensor& inputs, const at::Tensor& targets);

  // Inference on `inputs` as one micro-batch, stage after stage (shapes travel with the data, so
  // they may change from call to call): the last stage's output, on every rank. Collective.
  at::Tensor forward(const at::Tensor& inputs);

  // When on, step() records when each action of this rank ran (seconds on the steady clock, the
  // same on every process of a machine), for measured bubbles and timelines (to_svg).
  void record_timeline(bool on) { record_ = on; }
  const std::vector<TimedAction>& last_timeline() const { return timeline_; }
  // The last recorded step of the whole pipeline (each position as its first rank saw it), with its
  // makespan and bubble, on every rank; draw it with to_svg. Collective over `group`. The clocks of
  // processes on one machine agree; across machines each rank's times are its own clock's.
  Simulation measured_step() const;
  const Schedule& schedule() const { return schedule_; }
  // Runs `schedule` from the next step on: another order of the same stages on the same ranks
  // (same stage placement and micro-batches, checked), e.g. one built for measured costs. Every
  // rank of the pipeline must switch before the same step. Validates.
  void reschedule(Schedule schedule);

  // The most micro-batches whose activations a stage held at once during the last step.
  int peak_live_micro_batches(int stage) const;
  // How many W actions of the last step restarted from where the weights' branches leave the
  // input-gradient path (the rest walked the graph again: a stage 0 whose first leaf module gave
  // no output with a gradient node).
  int split_weight_actions() const { return split_weight_actions_; }
  // How many receives of the last step were posted ahead in batches (batch_p2p; the first step
  // receives the shapes it needs for that first).
  int batched_receives() const;

 private:
  struct Slot;
  double run(const at::Tensor& inputs, const at::Tensor& targets, bool backward);
  // Runs this rank's part of a pass over the pipeline, then agrees with every rank on the outcome:
  // returns the sum over ranks of `pass`'s value, or throws on every rank when any rank failed,
  // naming the stage that failed, instead of leaving the others waiting for its messages.
  double agree(const std::function<double(FailureNotice&)>& pass);
  // `where` names the action for errors; it is called only when one happens.
  void on_stage(FailureNotice& notice, int stage, const std::function<std::string()>& where,
                const std::function<void()>& action);
  const PipelineStage& stage(int index) const;
  Schedule schedule_;
  std::vector<PipelineStage> stages_;
  comm::ProcessGroup group_;
  LossFn loss_;
  std::shared_ptr<StagePlacement> placement_;
  struct TiedCopy {
    at::Tensor param;          // this rank's copy
    comm::ProcessGroup group;  // the ranks holding a copy
  };
  std::vector<TiedCopy> tied_;
  void sum_tied_gradients();
  bool batch_p2p_ = true;
  int64_t batch_dim_ = 0;
  // Stage 0's stand-in input for splitting I from W: the output of the stage's first leaf module in
  // the executor's forward of stage 0 (`armed`), set by a forward hook that holds it weakly.
  struct StandIn {
    bool armed = false;
    at::Tensor output;
  };
  std::shared_ptr<StandIn> first_leaf_output_;
  std::shared_ptr<StageMessages> messages_;
  // The actions of a training pass (true) or a forward-only one (false), per position, and when this
  // position's sends are complete (sends_complete_after), computed on first use.
  struct PassPrograms {
    std::vector<std::vector<Action>> programs;
    std::vector<std::vector<Action>> sends_complete_after;
  };
  std::map<bool, PassPrograms> pass_programs_;
  const PassPrograms& pass_programs(bool backward);
  std::map<int, int> peak_live_;
  int split_weight_actions_ = 0;
  bool record_ = false;
  uint64_t passes_ = 0;  // names each pass's failure notice
  bool broken_ = false;
  std::string broken_reason_;
  std::vector<TimedAction> timeline_;
};

}  // namespace hp::pp
