// What one rank trains, as a model family's recipe builds it (parallelize_llama, ...): the whole
// model or this rank's pipeline stages, the pipeline executor when there is one, the loss, and what
// the optimizer, clipping and checkpoints need. hp::train::TrainStep runs it without asking how it
// was parallelized.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "hp/nn/module.h"
#include "hp/parallel/checkpoint.h"
#include "hp/pp/executor.h"

namespace hp::models {

// Whether `patterns` (RecipeOptions::offload_units) select the FSDP unit named `unit` (as
// ModelParts::fsdp_units names it): one matches its name, or the name of a module it lies in
// ("layers.*" takes "layers.3" and "layers.3.mlp.experts"; "root" only the model's own unit). No
// patterns select every unit. (A pipeline stage's units inside it: RecipeOptions::unit_fsdp.)
bool unit_selected(const std::vector<std::string>& patterns, const std::string& unit);

// Throws hp::Error (naming memory.offload_units) unless each of `patterns` selects a unit of
// `units` (ModelParts::fsdp_units) and each module it matches is one of them: with a pipeline a
// block is no unit (each stage is one), and a pattern naming blocks would offload only the units
// inside them.
void check_offload_units(const std::vector<std::string>& patterns, const std::vector<std::string>& units);

// The name of pipeline stage `stage`'s FSDP unit: "stage.N".
std::string stage_unit_name(int64_t stage);

// The names of the FSDP units below `model` ("root" for its own) and, with `stages` > 0, of the
// stages of a pipeline ("stage.0", ...): what a recipe lists in ModelParts::fsdp_units.
std::vector<std::string> fsdp_unit_names(nn::Module& model, int stages);

// Numbers a recipe's step hook reports for one step.
struct StepStats {
  std::vector<std::pair<std::string, double>> values;  // fields of the step's metrics.jsonl record
  std::string summary;                                 // appended to the progress line ("" = nothing)
};

struct ModelParts {
  // The whole model. Its FQNs name every parameter (checkpoint entries, optimizer state); pipeline
  // stages share its modules under the same FQNs.
  std::shared_ptr<nn::Module> model;
  // The modules this rank runs: {model}, or its pipeline stages in schedule order.
  std::vector<std::shared_ptr<nn::Module>> modules;
  // The blocks the recipe checkpointed (or swaps), by FQN in model order, with their stats.
  std::vector<std::pair<std::string, CheckpointedModule>> checkpointed;
  // Runs the stages with the other pipeline ranks; null without pipeline parallelism.
  std::unique_ptr<pp::PipelineExecutor> pipeline;
  // The training loss of the model's output and the targets (also the pipeline's).
  pp::LossFn loss;
  // FQNs of parameters this rank holds as a copy of one that another rank saves and counts once in
  // the gradient norm: a weight tied across pipeline stages, whose copies the pipeline keeps equal.
  std::set<std::string> copies;
  // FQN patterns for hp::get_hyper_optimizer: the hidden weight matrices (what Muon steps) and every
  // other parameter (stepped by AdamW beside it).
  std::vector<std::string> hidden_matrices, other_parameters;
  // The layout's FSDP units by name, every rank's (RecipeOptions::offload_units picks among them):
  // "root" for the model's own, a module's FQN for the others ("layers.3"), "stage.N" for the
  // stages of a pipeline, which are units of their own.
  std::vector<std::string> fsdp_units;
  // Runs on every rank once per step, after backward and before the optimizer steps (a mixture of
  // experts' load balancing); collective over the ranks the recipe gave it. Null: nothing to run.
  std::function<StepStats()> before_optimizer_step;
  // Forgets what the step's forwards counted for before_optimizer_step (a mixture of experts' token
  // counts): before the step runs again from its start (a rerun on an anomaly), and for a step that
  // is skipped (not finite), which must change nothing. Not collective. Null: nothing counted.
  std::function<void()> forget_step;

  // Draws the parameters of `modules` from `seed`, each with the values hp::nn::init_parameters
  // on the whole model gives it; a pipeline rank leaves the other stages' parameters without
  // storage. Not collective. Plain parameters are allocated on `device`, DTensor shards on their
  // mesh's device.
  void init_parameters(uint64_t seed, c10::Device device = c10::kCPU) const;
  // The parameters of `modules`, in order: what this rank's optimizer steps. Call it after
  // init_parameters (which may replace parameter tensors).
  std::vector<at::Tensor> parameters() const;
  // parameters() without the copies (each gradient element counted once), and the copies.
  std::vector<at::Tensor> counted_parameters() const;
  std::vector<at::Tensor> copied_parameters() const;
  // parameters() by FQN (hp::get_hyper_optimizer's patterns name them).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // Every parameter and buffer of `modules` by FQN, copies included (loading fills them too; a
  // save leaves them out).
  std::vector<std::pair<std::string, at::Tensor>> named_tensors() const;
};

}  // namespace hp::models
