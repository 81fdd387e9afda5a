#include "hp/train/train_step.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "hp/comm/tree_reduce.h"
#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/core/step_phase.h"
#include "hp/core/storage_tier.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"
#include "hp/nn/moe.h"
#include "hp/nn/token_coordinates.h"
#include "hp/parallel/fsdp.h"

namespace hp::train {
namespace {

// The relative bubble reduction the order built for measured costs must predict to replace the
// unit-cost order.
constexpr double kClearGain = 0.05;

at::Tensor whole(const at::Tensor& t) { return is_dtensor(t) ? DTensor(t).full_tensor() : t; }

// A dry run's loss is on the meta device and has no value.
double scalar(const at::Tensor& t) {
  return t.is_meta() ? std::numeric_limits<double>::quiet_NaN() : whole(t).detach().item<double>();
}

// The model's modules in evaluation mode (no dropout) for the scope, as they were after.
class EvalMode {
 public:
  explicit EvalMode(const models::ModelParts& parts) {
    // Every module's flag before any changes: eval() reaches the submodules too.
    for (const auto& part : parts.modules)
      for (const auto& module : part->modules()) modules_.push_back(module);
    for (const auto& module : parts.model->modules()) modules_.push_back(module);
    for (const auto& module : modules_) training_.push_back(module->is_training());
    for (const auto& module : modules_) module->eval();
  }
  ~EvalMode() {  // parents before their submodules (train() sets a module's whole subtree)
    for (size_t i = 0; i < modules_.size(); ++i) modules_[i]->train(training_[i]);
  }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;

 private:
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;  // each with its submodules
  std::vector<bool> training_;
};

}  // namespace

TrainStep::TrainStep(models::ModelParts& parts, TrainStepOptions options)
    : parts_(parts), options_(std::move(options)) {}

double TrainStep::forward_backward(int64_t step, const at::Tensor& inputs, const at::Tensor& targets) {
  if (parts_.pipeline) {
    pp::PipelineExecutor& pipe = *parts_.pipeline;
    const bool draw = step + 1 == options_.timeline_step;
    // A step run again (a rerun on an anomaly) is not profiled again (its first run was), and runs
    // the order its first run ran: a new order starts with the next step.
    const bool again = step == last_step_;
    if (!again) ++steps_run_, last_step_ = step;
    if (!again && next_order_) pipe.reschedule(*std::exchange(next_order_, std::nullopt));
    const bool profile = !again && profiles_nth(steps_run_);
    pipe.record_timeline(draw || profile);
    // The pipeline divides each micro-batch's loss by their number; auxiliary losses alike.
    const nn::AuxLossScale aux_scale(1.0 / static_cast<double>(pipe.schedule().micro_batches));
    const double loss = pipe.step(inputs, targets);
    if (draw || profile) {
      const pp::Simulation measured = pipe.measured_step();  // collective over the pipeline
      if (profile && !profile_)
        schedule_for(measured, step + 1);
      else if (profile)
        record_bubble(measured, step + 1);
      if (draw) draw_timeline(step + 1, measured);
    }
    return loss;
  }
  const int64_t micro = options_.micro_batches;
  HP_CHECK(micro > 0 && inputs.size(0) % micro == 0 && inputs.size(0) >= micro, "TrainStep: ", inputs.size(0),
           " rows do not split into ", micro, " equal micro-batches");
  const int64_t rows = inputs.size(0) / micro;
  const nn::AuxLossScale aux_scale(1.0 / static_cast<double>(micro));  // the loss's own scale below
  // Deterministic: FSDP units keep their gradients (sync off) until the last micro-batch and sum
  // them in tree order; the gradients of parameters outside any unit are summed here alike.
  std::vector<FSDPModule> units = options_.deterministic ? fsdp_units(*parts_.model) : std::vector<FSDPModule>{};
  std::vector<at::Tensor> params = options_.deterministic ? parts_.parameters() : std::vector<at::Tensor>{};
  std::vector<comm::TreeSum> grads(params.size());
  at::Tensor losses = at::empty({micro}, at::kDouble);
  for (int64_t m = 0; m < micro; ++m) {
    for (FSDPModule& unit : units) unit.set_requires_gradient_sync(m == micro - 1);
    const nn::MicroBatchRows where(m * rows);  // for draws by global position (dropout)
    at::Tensor loss;
    {
      const StepPhaseScope forward(StepPhase::kForward);
      loss = parts_.loss((*parts_.model)(inputs.narrow(0, m * rows, rows)), targets.narrow(0, m * rows, rows));
    }
    losses[m].fill_(scalar(loss));
    {
      const StepPhaseScope backward(StepPhase::kBackward);
      (micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
    }
    for (size_t i = 0; i < params.size(); ++i)
      if (at::Tensor& grad = params[i].mutable_grad(); grad.defined()) grads[i].add(std::exchange(grad, at::Tensor()));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (grads[i].empty()) continue;
    params[i].mutable_grad() = grads[i].take();
    // With parameter offload, the sum lives (settled) where its parameter does, as FSDP's own
    // gradients do.
    if (StorageTier* tier = storage_tier_of(local_tensor(params[i])))
      move_storage_to(local_tensor(params[i].grad()), *tier);
  }
  return comm::tree_reduce(losses, comm::ReduceOp::kSum).item<double>() / static_cast<double>(micro);
}

double TrainStep::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  at::NoGradGuard no_grad;
  const EvalMode eval(parts_);
  if (parts_.pipeline) return parts_.pipeline->evaluate(inputs, targets);
  return scalar(parts_.loss((*parts_.model)(inputs), targets));
}

at::Tensor TrainStep::logits(const at::Tensor& inputs) {
  at::NoGradGuard no_grad;
  const EvalMode eval(parts_);
  return whole(parts_.pipeline ? parts_.pipeline->forward(inputs) : (*parts_.model)(inputs));
}

// The step after the profiled one: the bubble the order it runs gives.
void TrainStep::record_bubble(const pp::Simulation& measured, int64_t step) {
  profile_->measured_bubble = measured.bubble;
  if (options_.lead)
    log::info("pipeline bubble of step ", step, ": ", 100.0 * measured.bubble, "% measured, ",
              100.0 * (profile_->rescheduled ? profile_->predicted_bubble : profile_->unit_order_bubble),
              "% predicted from the costs of step ", profile_->step);
}

// The profiled step: order the schedule for the costs it measured (rank 0's, on every rank).
void TrainStep::schedule_for(const pp::Simulation& measured, int64_t step) {
  pp::PipelineExecutor& pipe = *parts_.pipeline;
  pp::ActionCosts mine = pp::measured_costs(measured);
  // Every rank sends a buffer of the same size into the broadcast (a stage the step did not show
  // takes the means), whatever it measured; rank 0's values are everyone's.
  const int stages = pipe.schedule().stages;
  mine.by_stage.resize(stages, pp::StageCosts{mine.forward, mine.backward_input, mine.backward_weight});
  std::vector<double> values = {mine.forward, mine.backward_input, mine.backward_weight, mine.send, mine.overhead};
  for (const pp::StageCosts& s : mine.by_stage)
    values.insert(values.end(), {s.forward, s.backward_input, s.backward_weight});
  const at::Tensor agreed = options_.world.broadcast(at::tensor(values, at::kDouble), 0);
  const double* c = agreed.data_ptr<double>();
  PipelineProfile profile;
  profile.step = step;
  profile.costs = {c[0], c[1], c[2], c[3], c[4], {}};
  for (int s = 0; s < stages; ++s) profile.costs.by_stage.push_back({c[5 + 3 * s], c[6 + 3 * s], c[7 + 3 * s]});
  profile.profiled_bubble = measured.bubble;
  profile.unit_order_bubble = pp::simulate(pipe.schedule(), profile.costs).bubble;
  const pp::Schedule& before = pipe.schedule();
  pp::Schedule ordered = pp::schedule_by_name(options_.schedule_name, before.ranks, before.micro_batches,
                                              options_.stages_per_rank, profile.costs);
  profile.predicted_bubble = pp::simulate(ordered, profile.costs).bubble;
  // The prediction errs by about a tenth (bench_pp), so a smaller gain is no gain: the unit order stays.
  profile.rescheduled = profile.predicted_bubble < (1.0 - kClearGain) * profile.unit_order_bubble;
  if (profile.rescheduled) next_order_ = std::move(ordered);
  if (options_.lead) {
    log::info("pipeline schedule ", options_.schedule_name,
              profile.rescheduled ? " ordered for the costs step " : " kept: its unit-cost order suits the costs step ",
              step, " measured (F ", 1e3 * profile.costs.forward, " ms, I ", 1e3 * profile.costs.backward_input,
              " ms, W ", 1e3 * profile.costs.backward_weight, " ms on average, send ", 1e3 * profile.costs.send,
              " ms, overhead ", 1e3 * profile.costs.overhead, " ms per action): predicted bubble ",
              100.0 * profile.predicted_bubble, "% (the unit-cost order: ", 100.0 * profile.unit_order_bubble,
              "% predicted, ", 100.0 * profile.profiled_bubble, "% measured)");
    std::ostringstream stages_line;
    for (int s = 0; s < stages; ++s)
      stages_line << (s ? "; " : "") << s << ": " << 1e3 * profile.costs.by_stage[s].forward << " / "
                  << 1e3 * profile.costs.by_stage[s].backward_input << " / "
                  << 1e3 * profile.costs.by_stage[s].backward_weight;
    log::info("pipeline stage costs F / I / W in ms (stage: costs): ", stages_line.str());
  }
  profile_ = profile;
}

// The measured timeline of that step, drawn as hp-pp-viz draws schedules. The lead writes its
// pipeline's.
void TrainStep::draw_timeline(int64_t step, const pp::Simulation& measured) const {
  const pp::PipelineExecutor& pipe = *parts_.pipeline;
  if (!options_.lead) return;
  const std::filesystem::path path(options_.timeline_path);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream(path) << pp::to_svg(pipe.schedule(), measured,
                                    pipe.schedule().name + ", step " + std::to_string(step) + " (measured)");
  log::info("pipeline timeline of step ", step, ": bubble ", 100.0 * measured.bubble, "% over ",
            1e3 * measured.makespan, " ms, drawn in ", path.string());
}

}  // namespace hp::train
