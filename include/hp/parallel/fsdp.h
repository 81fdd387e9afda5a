// Fully sharded data parallelism (PyTorch FSDP2's fully_shard), applied per unit from outside:
//
//   for (auto& [fqn, block] : hp::nn::match_modules(model, "layers.*")) hp::fully_shard(*block, dp_mesh);
//   hp::fully_shard(model, dp_mesh);                 // the root takes the remaining parameters
//   hp::nn::init_parameters(model, seed);            // each rank allocates 1/N of every parameter
//
// Each unit's parameters become DTensors Shard(0) on the data-parallel mesh (a 2-D mesh
// (replicate, shard) gives HSDP: [Replicate, Shard(0)]); uneven first dims are allowed (torch.chunk
// pieces, padded internally). Calling the unit all-gathers its parameters into plain tensors (one
// collective per unit), runs forward on them, and puts the sharded DTensors back. Backward
// gathers them again where the forward freed them, and the gradient of the gather is a
// reduce-scatter: each rank receives its shard of the gradient, averaged (or summed) over the
// data-parallel ranks, as the sharded parameter's .grad. Optimizers and checkpoints only ever see
// the sharded DTensors.
#pragma once

#include <c10/core/ScalarType.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hp/comm/types.h"
#include "hp/dtensor/placement.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/module.h"
#include "hp/parallel/offload.h"

namespace hp {

// Mixed precision (FSDP2's MixedPrecisionPolicy). Unset fields keep the parameters' dtype.
struct MixedPrecisionPolicy {
  // Forward and backward compute with parameters in this dtype; shards are cast before the
  // all_gather, so communication shrinks too, and the unit's floating-point inputs are cast to it.
  // The sharded parameters and the optimizer keep their dtype. Unset: the parameters' own dtype
  // (fp32 when a unit mixes dtypes).
  std::optional<at::ScalarType> param_dtype;
  // Gradients are reduced in this dtype (default: param_dtype), then cast to the shards' dtype.
  std::optional<at::ScalarType> reduce_dtype;
  // The format gradients travel in between data-parallel ranks (every reduction of the unit: the
  // reduce-scatter, ZeRO-1's all-reduce, HSDP's all-reduce across replicas, which rounds the
  // shard group's result again). kBf16 / kFp8E4M3 round each rank's gradient to that format and
  // add in fp32 in the fixed tree order: for fp32 gradients, 1/2 / about 1/4 of a reduce-scatter's
  // bytes, 3/4 / 5/8 of an all-reduce's (docs/collectives.md#low-precision-reductions).
  comm::WireFormat reduce_wire = comm::WireFormat::kNative;
  // The unit's output is cast to this dtype (e.g. fp32 logits for the loss).
  std::optional<at::ScalarType> output_dtype;
};

// How much is sharded (ZeRO stages). Every level keeps the optimizer's view the same: sharded
// DTensor parameters with sharded gradients, so levels change memory and communication only.
enum class ShardingLevel {
  kOptimizer = 1,   // ZeRO-1: parameters stay gathered between steps (re-gathered only after the
                    // shards change); gradients are all-reduced and kept whole on every rank
  kGradients = 2,   // ZeRO-2: parameters stay gathered; gradients are reduce-scattered
  kParameters = 3,  // ZeRO-3 / FSDP: parameters are gathered per use and released after
};

struct FullyShardOptions {
  // Free the gathered parameters after forward and gather them again for backward (ZeRO-3). Off:
  // keep them from forward to backward (more memory, one all_gather less per step).
  bool reshard_after_forward = true;
  // FSDP2's integer reshard_after_forward: with reshard_after_forward on, keep the parameters after
  // forward sharded over blocks of this many neighbouring shard ranks (the ranks of one node, say)
  // instead of all of them, so backward gathers them within the block. Each rank then holds 1/k of
  // the unit's parameters from forward to backward. 0: the whole shard group (plain FSDP). Must
  // divide the shard group's size; ZeRO-3 only.
  int reshard_after_forward_to = 0;
  // How gradients combine across data-parallel ranks: kAvg (the mean over ranks, for a loss that is
  // a mean over each rank's batch) or kSum.
  comm::ReduceOp reduce_op = comm::ReduceOp::kAvg;
  MixedPrecisionPolicy mixed_precision;
  ShardingLevel level = ShardingLevel::kParameters;
  // Which dim to split each parameter on (FSDP2's shard_placement_fn): return Shard(d), or nullopt
  // for the default Shard(0). Called with the parameter's FQN relative to the unit.
  std::function<std::optional<Placement>(const std::string& fqn, const at::Tensor& param)> shard_placement_fn;
  // Parameters (FQN patterns relative to the unit, '*' = one segment) the unit leaves alone: not
  // sharded, not gathered, gradients not reduced.
  std::vector<std::string> ignored_params;
  // Keep the unit's shards, their gradients and (with hp's optimizers) their optimizer state in this
  // tier between uses (hp/parallel/offload.h); null: in the compute allocator. Units may share one.
  std::shared_ptr<ParameterOffload> offload;
};

namespace detail {
struct FsdpUnit;
}

// The handle of one fully_shard unit.
class FSDPModule {
 public:
  explicit FSDPModule(std::shared_ptr<detail::FsdpUnit> unit) : unit_(std::move(unit)) {}

  // Gathers the parameters now (e.g. to run the module outside forward) / puts the shards back.
  void unshard();
  void reshard();
  // False: backward keeps accumulating the gathered (unsharded) gradients locally without any
  // communication (gradient accumulation); the next backward with sync on reduce-scatters the sum.
  void set_requires_gradient_sync(bool sync);
  void set_reduce_op(comm::ReduceOp op);
  // Multiplies gradients before they are reduced (e.g. 1 / accumulation steps).
  void set_gradient_scaling_factor(double factor);
  // Prefetching: when this unit gathers its parameters for forward (for backward), it also issues,
  // asynchronously, the gathers of `modules`, so that their communication overlaps this unit's
  // compute (with parameter offload their shards are read from the tier when the gather is issued,
  // on this thread). Name units that run next, once per step, in the same order on every rank
  // (e.g. forward: the next block; backward: the previous block). By default a unit prefetches nothing in forward and,
  // in backward, the unit that ran before it in forward; an empty list prefetches nothing.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);

 private:
  std::shared_ptr<detail::FsdpUnit> unit_;
};

// Shards the parameters of `module` that no inner unit took. Apply to inner units first.
FSDPModule fully_shard(nn::Module& module, const DeviceMesh& mesh, FullyShardOptions options = {});

// The fully_shard units of `root` and of the modules below it, depth first: e.g. to turn gradient
// sync off for every unit of a model during gradient accumulation.
std::vector<FSDPModule> fsdp_units(nn::Module& root);
// The same, each with the FQN of its module below `root` ("" for root itself).
std::vector<std::pair<std::string, FSDPModule>> named_fsdp_units(nn::Module& root);

// Prefetching `depth` modules ahead along `chain`, modules below `root` that run one after the
// other in forward and in the reverse order in backward (a model's blocks): each one's unit
// issues, when it gathers, the gathers of the units of the next `depth` modules in forward and of
// the previous `depth` in backward (a module's units: its own and those below it, which then
// prefetch nothing themselves); root's own unit, which runs first both ways, those of the first
// `depth` modules in forward and of the last `depth` in backward. Every other unit below root
// prefetches nothing, and with depth 0 none does: each gathers at its own use. Call it once every
// unit is made. A prefetched gather holds its unit's gathered parameters from then on, and its
// packed shards until it completes: depth d costs up to d x (1 + 1/n) modules' parameters more at
// the peak, n the units' shard ranks. Checkpointed modules gather again in their recomputation, at
// their use: backward prefetches none of their gathers.
void set_prefetch_depth(nn::Module& root, const std::vector<nn::Module*>& chain, int depth);

}  // namespace hp
