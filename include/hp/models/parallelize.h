// How the Llama family is parallelized, kept outside the model file (torchtitan style): the
// tensor-parallel plan, then FSDP units (each block, then the root), on a mesh built from the
// parallel dims of a training config.
#pragma once

#include <cstdint>
#include <string>

#include "hp/comm/process_group.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/llama.h"
#include "hp/parallel/fsdp.h"
#include "hp/parallel/tensor_parallel.h"

namespace hp::models {

// Degrees of parallelism; their product is the world size. cp and ep are reserved (must be 1).
struct ParallelDims {
  int64_t dp_replicate = 1, dp_shard = 1, tp = 1, pp = 1, cp = 1, ep = 1;
  int64_t product() const { return dp_replicate * dp_shard * tp * pp * cp * ep; }
  int64_t dp() const { return dp_replicate * dp_shard; }
  // Throws hp::Error with the documented message when the dims do not fit `world_size` or `model`.
  void validate(int64_t world_size, const LlamaConfig& model) const;
  std::string str() const;  // "dp_replicate=1 dp_shard=2 tp=2 pp=1"
};

// Mesh (pp, dp_replicate, dp_shard, tp) over the world, row-major: tp is innermost (neighbouring
// ranks), pp outermost.
DeviceMesh build_mesh(const comm::ProcessGroup& world, const ParallelDims& dims);

struct TpOptions {
  bool sequence_parallel = false;
  bool loss_parallel = false;
};

// The tensor-parallel plan of Llama: attention and MLP split column- then row-wise (Megatron), the
// embedding row-wise, the head column-wise (vocabulary-sharded logits with loss_parallel).
ParallelizePlan llama_tp_plan(TpOptions options);

struct LlamaParallelOptions {
  TpOptions tp;
  FullyShardOptions fsdp;
};

// Applies TP on mesh["tp"] (when tp > 1) and FSDP on the data-parallel dims (when dp > 1; a 2-D
// (dp_replicate, dp_shard) mesh gives HSDP). Call before hp::nn::init_parameters.
void parallelize_llama(Llama& model, const DeviceMesh& mesh, const ParallelDims& dims,
                       const LlamaParallelOptions& options = {});

// Pipeline stages of `model`: stage i runs the next layers_per_stage[i] blocks; the embedding joins
// the first stage and the final norm and head the last (a stage may have no blocks). The stages
// share the model's modules, so parameters keep their identity (and init_parameters on the whole
// model initializes them).
// With tie_embeddings, the last stage's head uses the embedding too and holds it as "embed" (so
// "embed.weight" in both the first and the last stage): run such stages on different ranks and
// tie them with PipelineOptions::tied = {{"embed.weight", {0, last}}}.
std::vector<std::shared_ptr<nn::Module>> split_llama(Llama& model, const std::vector<int64_t>& layers_per_stage);

}  // namespace hp::models
