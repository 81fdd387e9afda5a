// A model family as a config-driven trainer sees it (hp-train's model.* keys): the family's config
// fields, its checks, the numbers the trainer reports, and its recipe. One subclass per family
// (include/hp/models/<family>/spec.h), registered by name in src/models/registry.cpp; the trainer
// knows no family.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "hp/comm/types.h"
#include "hp/core/error.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/model_parts.h"
#include "hp/models/registry.h"
#include "hp/parallel/checkpoint.h"
#include "hp/parallel/context_parallel.h"
#include "hp/parallel/fsdp.h"
#include "hp/parallel/parallel_dims.h"
#include "hp/pp/schedule.h"

namespace hp::models {

struct TpOptions {
  bool sequence_parallel = false;
  bool loss_parallel = false;
  // The format of the plan's reductions of activations and their gradients (set_reduce_wire on the
  // styles that reduce: hp/parallel/tensor_parallel.h).
  comm::WireFormat wire = comm::WireFormat::kNative;
  // Async TP (set_async_tp on the styles: hp/parallel/tensor_parallel.h): needs sequence_parallel
  // and a native wire.
  bool async_tp = false;
  // With async_tp: the layers on one input (q/k/v, gate/up) share one gather (hp::ShareInputGather);
  // false: each gathers its own (for measuring what sharing saves).
  bool share_input_gathers = true;
};

// With parallel.pp > 1: the schedule (hp::pp::schedule_by_name) and how many micro-batches it
// splits each rank's batch into.
struct PipelineOptions {
  std::string schedule = "1f1b";
  int stages_per_rank = 2;  // interleaved only
  int micro_batches = 1;
  std::vector<int64_t> layers_per_stage;  // each stage's layers, in stage order; empty: equal ranges
  pp::ActionCosts costs;                  // what the zero-bubble schedules order for
};

// How a recipe applies the parallel dims (TP details, FSDP's options, the pipeline's schedule) and
// activation checkpointing (of every block, or block by block).
struct RecipeOptions {
  TpOptions tp;
  FullyShardOptions fsdp;
  PipelineOptions pipeline;
  ContextParallel cp;  // applied to the core attention with parallel.cp > 1
  CheckpointMode checkpoint = CheckpointMode::kNone;
  // One mode per block, in layer order, in place of `checkpoint` (empty: `checkpoint` for all).
  std::vector<CheckpointMode> block_checkpoint;
  SwapOptions swap;  // for the blocks of mode kSwap
  // With parameter offload (fsdp.offload set), the FSDP units it applies to, as patterns of unit
  // names ('*' = one segment) that also take the units inside the units they match: "root" (the
  // model's own unit), "layers.3", "layers.*.mlp.experts", "stage.1" (docs/memory.md). Empty: every
  // unit. ModelParts::fsdp_units lists a layout's names; check_offload_units checks the patterns.
  std::vector<std::string> offload_units;
  // With parameter offload, how many blocks ahead each block's units gather and start reading their
  // shards from the tier (hp::set_prefetch_depth). Without a pipeline only.
  int offload_prefetch = 1;

  // fsdp for the unit named `unit`, without the offload tier when offload_units selects neither it
  // nor the pipeline stage (`stage`, "stage.N") it lies in.
  FullyShardOptions unit_fsdp(const std::string& unit, FullyShardOptions fsdp, const std::string& stage = {}) const {
    if (!unit_selected(offload_units, unit) && (stage.empty() || !unit_selected(offload_units, stage)))
      fsdp.offload.reset();
    return fsdp;
  }
};

// A config field of one of four types, pointing into the spec that owns it.
using ConfigFieldRef = std::variant<int64_t*, double*, bool*, std::string*>;
using ConfigFields = std::vector<std::pair<std::string, ConfigFieldRef>>;

class ModelSpec {
 public:
  virtual ~ModelSpec() = default;
  virtual std::unique_ptr<ModelSpec> clone() const = 0;
  virtual std::string family() const = 0;
  // The family's keys under "model." (without the prefix), in documentation order.
  virtual ConfigFields fields() = 0;
  // Throws hp::Error naming the first inconsistent field.
  virtual void validate() const = 0;
  // What the recipe needs of the dims (divisibility, dims it does not support yet), after
  // dims.validate(world); throws hp::Error naming the config keys.
  virtual void validate_parallel(const ParallelDims& dims, const RecipeOptions& options) const = 0;

  virtual int64_t vocab() const = 0;
  virtual int64_t max_seq() const = 0;
  virtual int64_t layers() const = 0;  // the blocks that pipeline stages split evenly
  virtual int64_t parameter_count() const = 0;
  // Training FLOPs per token at sequence length `seq` (forward + backward).
  virtual double flops_per_token(int64_t seq) const = 0;
  // An estimate of the activation bytes one token keeps for backward on one rank.
  virtual double activation_bytes_per_token(const ParallelDims& dims) const = 0;
  // One line for the dry-run plan, e.g. "llama dim 128, 2 layers, 4 heads (2 KV), ffn 384, vocab 256".
  virtual std::string describe() const = 0;

  // The family's recipe on the mesh of hp::build_mesh(world, dims); parameters still uninitialized.
  // Collective over the world the mesh was built from.
  virtual ModelParts build(const DeviceMesh& mesh, const ParallelDims& dims, const RecipeOptions& options) const = 0;
};

// The spec of a family whose config is the struct `Config` (ModelConfig::as<Config>() reaches it).
template <typename Config>
class ModelSpecOf : public ModelSpec {
 public:
  explicit ModelSpecOf(Config c) : config(std::move(c)) {}
  Config config;
};

template <typename Config>
Config& ModelConfig::as() {
  auto* spec = dynamic_cast<ModelSpecOf<Config>*>(spec_.get());
  HP_CHECK(spec != nullptr, "ModelConfig::as: model.family is ", spec_->family(), ", whose config is another type");
  return spec->config;
}

template <typename Config>
const Config& ModelConfig::as() const {
  return const_cast<ModelConfig*>(this)->as<Config>();
}

}  // namespace hp::models
