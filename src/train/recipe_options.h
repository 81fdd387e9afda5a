// How the training config asks a model family's recipe to apply the parallel dims.
#pragma once

#include <memory>
#include <optional>

#include "hp/core/error.h"
#include "hp/models/model_spec.h"
#include "hp/train/config.h"

namespace hp::train::detail {

// The costs parallel.pp_costs gives the first schedule: unit for "measured" and "unit".
inline pp::ActionCosts pipeline_costs(const TrainConfig& c) {
  if (c.pp_costs == "measured" || c.pp_costs == "unit") return {};
  const std::optional<pp::ActionCosts> costs = pp::parse_costs(c.pp_costs);
  HP_CHECK(costs, "parallel.pp_costs '", c.pp_costs,
           "' is not measured, unit, or positive relative costs F,I,W or F,I,W,send (e.g. 1,1.2,0.7)");
  return *costs;
}

inline models::RecipeOptions recipe_options(const TrainConfig& c) {
  models::RecipeOptions options;
  options.tp = {c.sequence_parallel, c.loss_parallel, tp_wire_of(c), c.async_tp};
  options.fsdp.reshard_after_forward = c.reshard_after_forward;
  options.fsdp.reshard_after_forward_to = static_cast<int>(c.reshard_after_forward_to);
  options.pipeline = {c.pp_schedule, static_cast<int>(c.pp_stages_per_rank), static_cast<int>(c.micro_batches()),
                      c.pp_layers_per_stage, pipeline_costs(c)};
  if (c.parallel.cp > 1)
    options.cp.set_mode(cp_mode_named(c.cp_mode)).set_ulysses_degree(c.cp_ulysses).set_async(c.cp_async);
  options.checkpoint = *checkpoint_mode_named(c.memory.checkpoint);
  for (const std::string& block : c.memory.blocks)
    options.block_checkpoint.push_back(*checkpoint_mode_named(block, /*swap=*/true));
  if (c.memory.swap != "none") {
    if (c.memory.blocks.empty()) options.checkpoint = CheckpointMode::kSwap;
    options.swap.prefetch = static_cast<int>(c.memory.swap_prefetch);
    if (c.memory.swap == "file") {
      options.swap.tier = SwapOptions::Tier::kFile;
      options.swap.directory = c.memory.swap_dir.empty() ? c.run_dir : c.memory.swap_dir;
    }
  }
  MixedPrecisionPolicy& mixed = options.fsdp.mixed_precision;
  if (c.train.dtype == "bf16") {
    mixed.param_dtype = at::kBFloat16;
    mixed.output_dtype = at::kFloat;  // the root's output: fp32 logits for the loss
  }
  if (c.train.dtype != c.train.mixed_precision_reduce)
    mixed.reduce_dtype = c.train.mixed_precision_reduce == "bf16" ? at::kBFloat16 : at::kFloat;
  mixed.reduce_wire = gradient_wire_of(c);
  return options;
}

// recipe_options, with the tier memory.offload names for the FSDP units memory.offload_units
// selects, and its prefetch depth (made here, not in recipe_options, which validation calls too: a
// file tier makes its file).
inline models::RecipeOptions recipe_options_for_training(const TrainConfig& c) {
  models::RecipeOptions options = recipe_options(c);
  if (c.memory.offload != "none") {
    options.offload_units = c.memory.offload_units;
    options.offload_prefetch = static_cast<int>(c.memory.offload_prefetch);
    OffloadOptions offload;
    if (c.memory.offload == "file") {
      offload.tier = OffloadOptions::Tier::kFile;
      offload.directory = c.memory.offload_dir.empty() ? c.run_dir : c.memory.offload_dir;
    }
    options.fsdp.offload = std::make_shared<ParameterOffload>(offload);
  }
  return options;
}

}  // namespace hp::train::detail
