// What a training run and a dry run of it (hp::train::dry_run) build alike from the config: the
// mesh, the model parts this rank trains, and the optimizer.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "hp/mesh/device_mesh.h"
#include "hp/models/model_parts.h"
#include "hp/nn/token_coordinates.h"
#include "hp/train/config.h"
#include "hp/train/train_step.h"

namespace hp::train::detail {

// The mesh and the model parts this rank trains, built from the config in the same order on every
// rank (the recipe issues collectives).
struct Setup {
  DeviceMesh mesh;
  models::ModelParts parts;
  int64_t dp_rank = 0;          // which rows of each global batch this rank reads
  int64_t cp = 1, cp_rank = 0;  // which tokens of each row (cp_shard's cut)

  // This rank's tokens of a batch of rows [rows, seq] (inputs or targets, shifted before they come
  // here), on the rank's device.
  at::Tensor shard_sequence(const at::Tensor& batch) const;

  // Where this rank's rows and tokens of step `step`'s batch sit in it, for draws by global
  // position (dropout masks).
  nn::TokenCoordinates coordinates(const TrainConfig& c, int64_t step, int64_t first_row) const;

  // Plain logits [1, n, vocab] of tokens [1, n] for any n up to model.max_seq. Under cp the
  // sequence is padded at its end to a multiple of 2 x cp (the model is causal: later tokens change
  // no earlier position's logits; only a MoE capacity, per rank, counts them), cut as in training,
  // and the logits gathered back over the cp ranks. Collective over the model's ranks. The tokens
  // and the logits are on the host.
  at::Tensor sequence_logits(TrainStep& step, const at::Tensor& tokens) const;
};

Setup build(const TrainConfig& c, const comm::ProcessGroup& world);

// The optimizer of train.optimizer over `params` (this rank's).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c, const models::ModelParts& parts,
                                                        const std::vector<at::Tensor>& params);

}  // namespace hp::train::detail
