#include "train/setup.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include "hp/dtensor/random.h"
#include "hp/models/model_spec.h"
#include "hp/optim/adamw.h"
#include "hp/optim/chained.h"
#include "hp/optim/muon.h"
#include "hp/parallel/context_parallel.h"
#include "hp/parallel/parallel_dims.h"
#include "train/recipe_options.h"

namespace hp::train::detail {

at::Tensor Setup::shard_sequence(const at::Tensor& batch) const {
  const at::Tensor mine = cp > 1 ? cp_shard(batch, 1, cp, cp_rank) : batch;
  return mine.is_meta() ? mine : mine.to(mesh.device());  // a dry run's tokens stay on meta
}

nn::TokenCoordinates Setup::coordinates(const TrainConfig& c, int64_t step, int64_t first_row) const {
  nn::TokenCoordinates where;
  where.step = step;
  where.first_row = first_row;
  where.global_rows = c.train.global_batch;
  if (cp > 1) where.positions = cp_positions(c.data.seq_len, cp, cp_rank);
  where.global_seq = c.data.seq_len;
  return where;
}

at::Tensor Setup::sequence_logits(TrainStep& step, const at::Tensor& tokens) const {
  if (cp == 1) return step.logits(tokens.to(mesh.device())).to(at::kCPU);
  const int64_t n = tokens.size(1), padded = (n + 2 * cp - 1) / (2 * cp) * (2 * cp);
  const at::Tensor whole = at::constant_pad_nd(tokens, {0, padded - n}, 0);
  return cp_unshard(step.logits(shard_sequence(whole)), 1, mesh.get_group("cp")).narrow(1, 0, n).to(at::kCPU);
}

Setup build(const TrainConfig& c, const comm::ProcessGroup& world) {
  DeviceMesh mesh = build_mesh(world, c.parallel, c.train.device);
  manual_seed(mesh, c.seed);  // DTensor random ops in a recipe's model draw under the run's seed
  models::ModelParts parts = c.model->build(mesh, c.parallel, recipe_options_for_training(c));
  models::check_offload_units(c.memory.offload_units, parts.fsdp_units);
  const int64_t dp_rank = mesh.get_local_rank("dp_replicate") * c.parallel.dp_shard + mesh.get_local_rank("dp_shard");
  const int64_t cp_rank = mesh.get_local_rank("cp");
  return {std::move(mesh), std::move(parts), dp_rank, c.parallel.cp, cp_rank};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c, const models::ModelParts& parts,
                                                        const std::vector<at::Tensor>& params) {
  torch::optim::AdamWOptions adamw(c.optimizer.lr);
  adamw.betas({c.optimizer.beta1, c.optimizer.beta2}).eps(c.optimizer.eps).weight_decay(c.optimizer.weight_decay);
  if (c.optimizer.name == "adamw") return std::make_unique<AdamW>(params, adamw);
  MuonOptions muon(c.optimizer.muon_lr);
  muon.momentum(c.optimizer.muon_momentum).weight_decay(c.optimizer.weight_decay);
  // This rank's modules' parameters: a pipeline rank's stages hold part of the model.
  return std::make_unique<ChainedOptimizer>(
      get_hyper_optimizer(parts.named_parameters(), parts.hidden_matrices, parts.other_parameters, muon, adamw));
}

}  // namespace hp::train::detail
