// The Qwen3-MoE recipe, outside the model file: expert parallelism on the expert mesh, each layer's
// experts one FSDP unit over the ranks that hold the same experts, then the dense part as the
// Llama recipe shards it.
//
//   hp::ParallelDims dims;  dims.dp_shard = 4;  dims.ep = 2;     // ep borrows from dp_shard
//   auto parts = hp::models::parallelize_qwen3_moe(hp::models::make_qwen3_moe(config),
//                                                  hp::build_mesh(world, dims), dims, config);
//   hp::nn::init_parameters(*parts.model, seed);
#pragma once

#include <memory>

#include "hp/mesh/device_mesh.h"
#include "hp/models/llama/parallelize.h"
#include "hp/models/model_parts.h"
#include "hp/models/model_spec.h"
#include "hp/models/qwen3_moe/model.h"
#include "hp/parallel/parallel_dims.h"

namespace hp::models {

// What the recipe needs of the dims beyond ParallelDims::validate: experts divisible by ep; the
// llama recipe's needs of attention and context parallelism. Throws hp::Error naming the keys.
void validate_qwen3_moe_dims(const ParallelDims& dims, const Qwen3MoeConfig& config);

// On the mesh of hp::build_mesh(world, dims), for a model of make_qwen3_moe(config):
//  - ep > 1: hp::ExpertParallel on every layer's MoE over the ep dim of
//    hp::build_expert_mesh(world, dims): each rank holds experts / ep experts;
//  - when any dim shards data (dp, cp, ep or tp > 1): every layer's experts become one fully_shard unit
//    on the expert-data ranks (efsdp, with dp_replicate as HSDP), split on dim 0 (experts) when
//    experts / ep >= efsdp, else on dim 1. Their gradients are divided by dp x cp (the ranks
//    whose mean losses reached them, as the dense blocks' are), not by efsdp: ep ranks' rows meet
//    in one expert, and tp ranks' rows are shares of one data-parallel rank's tokens;
//  - with tp > 1, each tp rank runs every layer's MoE on its shard of the sequence
//    (hp::models::LlamaMlp::kTokenSplit: with sequence parallelism as it comes, without it cut from
//    the replicated stream; no expert split, no redundant all_to_all), and each MoE (its router;
//    its experts are their own units) is one FSDP unit over the data-parallel and tp ranks
//    (hp::models::shard_over_data_and_tp), so the routers' gradients are summed over the tp ranks;
//    the auxiliary losses' statistics are summed over the cp and tp ranks, each of which holds a
//    share of every sequence (hp::nn::TokenSplit);
//  - with cp > 1, hp::ContextParallel (RecipeOptions::cp) on every layer's core attention, as in
//    the llama recipe; the MoE runs on the cp rank's positions as they come, and the routers'
//    load counts are summed over the cp ranks too;
//  - then the blocks and the root as parallelize_llama (FSDP over dp_shard, with dp_replicate HSDP),
//    or, with pp > 1, its pipeline stages (each stage's layers run their MoE as above: the ep and
//    efsdp ranks of a layer are ranks of the same pipeline position).
// Parameters are still uninitialized. Collective over the world the mesh was built from.
ModelParts parallelize_qwen3_moe(std::shared_ptr<Llama> model, const DeviceMesh& mesh, const ParallelDims& dims,
                                 const Qwen3MoeConfig& config, const RecipeOptions& options = {});

}  // namespace hp::models
