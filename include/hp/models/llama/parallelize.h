// The Llama recipe: how the family is parallelized, kept outside the model file (torchtitan style).
// Tensor parallelism first, then the pipeline split, then FSDP units; the result is the parts this
// rank trains (hp/models/model_parts.h).
//
//   hp::ParallelDims dims;  dims.dp_shard = 2;  dims.tp = 2;
//   hp::models::validate_llama_dims(dims, config);          // on top of dims.validate(world.size())
//   auto parts = hp::models::parallelize_llama(std::make_shared<Llama>(config), hp::build_mesh(world, dims),
//                                              dims, options);
//   hp::nn::init_parameters(*parts.model, seed);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hp/mesh/device_mesh.h"
#include "hp/models/llama/model.h"
#include "hp/models/model_parts.h"
#include "hp/models/model_spec.h"
#include "hp/parallel/fsdp.h"
#include "hp/parallel/parallel_dims.h"
#include "hp/parallel/tensor_parallel.h"

namespace hp::models {

// How the blocks' MLP meets tensor parallelism:
//  - kDense: the SwiGLU split column- then row-wise (Megatron);
//  - kTokenSplit: the MLP runs whole on each tp rank's share of the tokens (a mixture of experts:
//    no expert is split, expert parallelism may borrow the tp ranks). Its input is this rank's
//    sequence shard (with sequence parallelism as it comes, else cut from the replicated stream
//    without communication) and its output goes back to the stream's layout (as it is, or
//    all-gathered). model.ffn_hidden is then not used.
enum class LlamaMlp { kDense, kTokenSplit };

// What the family needs of the dims beyond ParallelDims::validate: heads, kv_heads, ffn_hidden (for
// a dense MLP) and vocab divisible by tp; ep refused (a dense model has no experts). Throws
// hp::Error naming the config fields and the dim.
void validate_llama_dims(const ParallelDims& dims, const LlamaConfig& model, LlamaMlp mlp = LlamaMlp::kDense);

// The tensor-parallel plan of Llama: attention split column- then row-wise (Megatron), the MLP as
// `mlp` says, the embedding row-wise, the head column-wise (vocabulary-sharded logits with
// loss_parallel).
ParallelizePlan llama_tp_plan(TpOptions options, LlamaMlp mlp = LlamaMlp::kDense);

using ShardPlacementFn = decltype(FullyShardOptions::shard_placement_fn);

// `user`'s choice where it makes one, else Shard(1) for a matrix with fewer rows than `ranks` and
// at least as many columns (a router's gate: one row per expert), else FSDP's default (Shard(0)).
ShardPlacementFn split_short_matrices_by_columns(ShardPlacementFn user, int64_t ranks);

// With a pipeline (dims.pp > 1), the name of the stage each of the model's `layers` layers runs in
// ("stage.0", ...), as options.pipeline splits them; empty names without one.
std::vector<std::string> llama_layer_stages(const ParallelDims& dims, const RecipeOptions& options, int64_t layers);
// The stage of the layer a module's FQN ("layers.3.mlp.experts") lies in, from llama_layer_stages;
// empty for none.
std::string layer_stage(const std::vector<std::string>& stages, const std::string& fqn);

// Makes each module of `model` matching one of `patterns` one FSDP unit over the data-parallel and
// tp ranks together (this pipeline position's dp_replicate x (dp_shard x tp) ranks), its gradients
// scaled by tp. For replicated parameters that each tp rank applies to its own share of the data
// (the QK-norms to its heads, a router to its tokens): their gradients are partial sums over the tp
// ranks, to be summed there and averaged over the data-parallel ranks. Call with tp > 1, before the
// units that contain the modules. options.fsdp for each, offloaded as options.offload_units says.
// Collective over the world the mesh was built from.
void shard_over_data_and_tp(nn::Module& model, const std::vector<std::string>& patterns, const DeviceMesh& mesh,
                            const ParallelDims& dims, const RecipeOptions& options);

// Applies TP on mesh["tp"] (when tp > 1), options.cp to every layer's core attention on mesh["cp"]
// (when cp > 1; the inputs are then this rank's cp_shard of each sequence) and FSDP on the
// data-parallel dims with cp (data_parallel_mesh, when dp x cp > 1; a 2-D (dp_replicate, dp_shard)
// mesh, or (dp_replicate, dp_shard_cp) with cp, gives HSDP) to the whole model; with dp x cp = 1,
// FSDP units of one rank when options.fsdp's mixed precision sets a param_dtype (they carry the
// policy). Call before hp::nn::init_parameters.
// Collective over the mesh's groups.
void parallelize_llama(Llama& model, const DeviceMesh& mesh, const ParallelDims& dims,
                       const RecipeOptions& options = {}, LlamaMlp mlp = LlamaMlp::kDense);

// The whole recipe on the mesh of hp::build_mesh(world, dims): TP and CP, then with dims.pp > 1 the
// pipeline split (equal layer ranges, this rank's stages each one FSDP unit on the data-parallel
// mesh, tied embeddings across the first and last stage), else FSDP as parallelize_llama. The
// parts' parameters are still uninitialized: call hp::nn::init_parameters(*parts.model, seed).
// Collective over the world the mesh was built from.
ModelParts parallelize_llama(std::shared_ptr<Llama> model, const DeviceMesh& mesh, const ParallelDims& dims,
                             const RecipeOptions& options = {}, LlamaMlp mlp = LlamaMlp::kDense);

}  // namespace hp::models
