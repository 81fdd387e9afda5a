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

#include "hp/mesh/device_mesh.h"
#include "hp/models/llama/model.h"
#include "hp/models/model_parts.h"
#include "hp/models/model_spec.h"
#include "hp/parallel/fsdp.h"
#include "hp/parallel/parallel_dims.h"
#include "hp/parallel/tensor_parallel.h"

namespace hp::models {

// What the family needs of the dims beyond ParallelDims::validate: heads, kv_heads, ffn_hidden and
// vocab divisible by tp; cp and ep refused until context and expert parallelism land. Throws
// hp::Error naming the config fields and the dim.
void validate_llama_dims(const ParallelDims& dims, const LlamaConfig& model);

// The tensor-parallel plan of Llama: attention and MLP split column- then row-wise (Megatron), the
// embedding row-wise, the head column-wise (vocabulary-sharded logits with loss_parallel).
ParallelizePlan llama_tp_plan(TpOptions options);

// Applies TP on mesh["tp"] (when tp > 1) and FSDP on the data-parallel dims (when dp > 1; a 2-D
// (dp_replicate, dp_shard) mesh gives HSDP) to the whole model. Call before hp::nn::init_parameters.
// Collective over the mesh's groups.
void parallelize_llama(Llama& model, const DeviceMesh& mesh, const ParallelDims& dims,
                       const RecipeOptions& options = {});

// The whole recipe on the mesh of hp::build_mesh(world, dims): TP, then with dims.pp > 1 the
// pipeline split (equal layer ranges, this rank's stages each one FSDP unit on the data-parallel
// mesh, tied embeddings across the first and last stage), else FSDP as parallelize_llama. The
// parts' parameters are still uninitialized: call hp::nn::init_parameters(*parts.model, seed).
// Collective over the world the mesh was built from.
ModelParts parallelize_llama(std::shared_ptr<Llama> model, const DeviceMesh& mesh, const ParallelDims& dims,
                             const RecipeOptions& options = {});

}  // namespace hp::models
