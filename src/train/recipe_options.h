// How the training config asks a model family's recipe to apply the parallel dims.
#pragma once

#include "hp/models/model_spec.h"
#include "hp/train/config.h"

namespace hp::train::detail {

inline models::RecipeOptions recipe_options(const TrainConfig& c) {
  models::RecipeOptions options;
  options.tp = {c.sequence_parallel, c.loss_parallel};
  options.fsdp.reshard_after_forward = c.reshard_after_forward;
  options.fsdp.reshard_after_forward_to = static_cast<int>(c.reshard_after_forward_to);
  options.pipeline = {c.pp_schedule, static_cast<int>(c.pp_stages_per_rank), static_cast<int>(c.micro_batches())};
  return options;
}

}  // namespace hp::train::detail
