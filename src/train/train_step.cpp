#include "hp/train/train_step.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <filesystem>
#include <fstream>

#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/dtensor/dtensor.h"
#include "hp/nn/moe.h"

namespace hp::train {
namespace {

at::Tensor whole(const at::Tensor& t) { return is_dtensor(t) ? DTensor(t).full_tensor() : t; }

double scalar(const at::Tensor& t) { return whole(t).detach().item<double>(); }

}  // namespace

TrainStep::TrainStep(models::ModelParts& parts, TrainStepOptions options)
    : parts_(parts), options_(std::move(options)) {}

double TrainStep::forward_backward(int64_t step, const at::Tensor& inputs, const at::Tensor& targets) {
  if (parts_.pipeline) {
    const bool draw = step + 1 == options_.timeline_step;
    parts_.pipeline->record_timeline(draw);
    // The pipeline divides each micro-batch's loss by their number; auxiliary losses alike.
    const nn::AuxLossScale aux_scale(1.0 / static_cast<double>(parts_.pipeline->schedule().micro_batches));
    const double loss = parts_.pipeline->step(inputs, targets);
    if (draw) draw_timeline(step + 1);
    return loss;
  }
  const int64_t micro = options_.micro_batches;
  HP_CHECK(micro > 0 && inputs.size(0) % micro == 0 && inputs.size(0) >= micro, "TrainStep: ", inputs.size(0),
           " rows do not split into ", micro, " equal micro-batches");
  const int64_t rows = inputs.size(0) / micro;
  const nn::AuxLossScale aux_scale(1.0 / static_cast<double>(micro));  // the loss's own scale below
  double loss_sum = 0.0;
  for (int64_t m = 0; m < micro; ++m) {
    const at::Tensor loss =
        parts_.loss((*parts_.model)(inputs.narrow(0, m * rows, rows)), targets.narrow(0, m * rows, rows));
    loss_sum += scalar(loss);
    (micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
  }
  return loss_sum / static_cast<double>(micro);
}

double TrainStep::evaluate(const at::Tensor& inputs, const at::Tensor& targets) {
  torch::NoGradGuard no_grad;
  if (parts_.pipeline) return parts_.pipeline->evaluate(inputs, targets);
  return scalar(parts_.loss((*parts_.model)(inputs), targets));
}

at::Tensor TrainStep::logits(const at::Tensor& inputs) {
  torch::NoGradGuard no_grad;
  return whole(parts_.pipeline ? parts_.pipeline->forward(inputs) : (*parts_.model)(inputs));
}

// The measured timeline of that step, drawn as hp-pp-viz draws schedules. Collective over the
// pipeline's ranks; the lead writes its pipeline's.
void TrainStep::draw_timeline(int64_t step) const {
  const pp::PipelineExecutor& pipe = *parts_.pipeline;
  const pp::Simulation measured = pipe.measured_step();
  if (!options_.lead) return;
  const std::filesystem::path path(options_.timeline_path);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream(path) << pp::to_svg(pipe.schedule(), measured,
                                    pipe.schedule().name + ", step " + std::to_string(step) + " (measured)");
  log::info("pipeline timeline of step ", step, ": bubble ", 100.0 * measured.bubble, "% over ",
            1e3 * measured.makespan, " ms, drawn in ", path.string());
}

}  // namespace hp::train
