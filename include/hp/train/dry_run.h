// A dry run: what one rank of a training job would hold in memory, found on this machine without
// the job's ranks or its compute.
//
//   const hp::train::TrainConfig config = hp::train::load_config("llama.yaml", {});
//   for (int rank = 0; rank < 8; ++rank)
//     std::cout << hp::train::dry_run(config, 8, rank).table();
//
// The rank is built by the trainer's own code (mesh, recipe, parallel plans, optimizer) on a fake
// world (hp::comm::fake_world) and runs two training steps (forward, loss and backward of every
// micro-batch, gradient clipping, the optimizer step) with its parameters, activations and
// gradients on the meta device: shapes and sizes, no values, no compute. A MemoryTracker counts what
// every meta tensor would take, and the host memory the step uses as in a real run, so the
// report's peak is what the trainer's `peak_mem_bytes` measures for the run's steps after the
// first (the first has no optimizer state yet). Like that measurement it leaves out the data.
//
// A pipeline rank is played together with the other ranks of its pipeline (one per stage position,
// on threads of this process), as each stage learns the shape of its input from the stage before.
//
// A mixture of experts' routers choose by a routing model (hp/train/routing_model.h): balanced
// unless told otherwise. What it covers: models whose forward and backward need no values but
// those routing counts.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "hp/train/config.h"
#include "hp/train/cost_model.h"
#include "hp/train/routing_model.h"

namespace hp::train {

struct DryRunReport {
  int rank = 0, world_size = 1;
  // Bytes this rank holds between steps, by what they are: its parameters (its shards), their
  // gradients, the optimizer's state, and the token files the data loader keeps in memory (-1
  // when the corpus is not prepared in data.cache_dir; the peaks then leave them out).
  int64_t parameter_bytes = 0, gradient_bytes = 0, optimizer_state_bytes = 0, data_bytes = 0;
  // The second step's peak, as the trainer measures it: what is held between steps (not the data)
  // plus the step's activations and temporaries at their most. Also that step's peak during forward and
  // backward, and during gradient clipping and the optimizer step.
  int64_t peak_bytes = 0, forward_backward_peak_bytes = 0, optimizer_peak_bytes = 0;
  // The workspace of async TP's fused ops (parallel.async_tp; hp/comm/fused_matmul.h), per rank,
  // where the tp ranks share a host: memory they map apart from the allocator, not in the peak
  // (between processes a tp group's tp workspaces lie in /dev/shm). 0 without async TP.
  int64_t fused_workspace_bytes = 0;
  // Ops that ran on tensors with values (the rest ran on meta tensors), by name, and those of them
  // that touched more than metadata (a tensor of more than 64 elements): none when the dry run
  // computed nothing real.
  std::map<std::string, int64_t> host_ops, host_compute;
  // Collectives issued in the second step (CommDebugMode's names), and the bytes this rank puts in.
  std::map<std::string, int64_t> collectives, collective_bytes;
  // What the peak is made of, by category, each present (0 where none): "parameters", "gradients"
  // and "optimizer state" (this rank's, as far as they live at the peak; gradients are those the
  // step's end holds), "activations" (made inside a module's call, kept for backward or on the way;
  // a checkpointed block's recomputation included), "communication buffers" (made inside a
  // collective: FSDP's gathered parameters, received pieces, reductions' buffers) and "temporaries"
  // (the rest: the loss, backward's and the optimizer's work). They add up to peak_bytes.
  std::map<std::string, int64_t> peak_by_category;
  // The largest contributors at the peak, largest first (at most 10): a category, activations by
  // the block that made them ("activations layers.3": its FQN up to the first number).
  std::vector<std::pair<std::string, int64_t>> top_at_peak;
  // With DryRunOptions::lifetimes: every allocation alive during the second step, one CSV row each:
  // id, bytes, category, block, and the event (an allocation or a free, counted from the step's
  // start) it was made and freed at (empty: alive at the step's end).
  std::string lifetimes_csv;
  // What the second step did, for the cost model (hp/train/cost_model.h): its ops' classes and work,
  // its collectives by group size, by phase.
  StepWork work;

  // A table of the above, in MiB.
  std::string table() const;
  // The above as one JSON object (bytes), keys as the fields are named.
  std::string json() const;
  // Whether the peak, grown by `allocator_slack` (what the allocator holds beyond what tensors
  // use: fragmentation, cached blocks; 0.1 is 10%), fits in `limit_bytes`.
  bool fits(int64_t limit_bytes, double allocator_slack = 0.1) const;
};

struct DryRunOptions {
  // What a mixture of experts' routers choose in the dry run.
  RoutingModel routing = RoutingModel::balanced();
  // Fill DryRunReport::lifetimes_csv.
  bool lifetimes = false;
};

// Runs the dry run of rank `rank` of a job of `world_size` ranks (validated like a training run).
DryRunReport dry_run(const TrainConfig& config, int world_size, int rank, const DryRunOptions& options = {});

// The dry runs of the ranks of `rank`'s pipeline, one per position in position order (played
// together, as dry_run does); without pp, `rank`'s alone.
std::vector<DryRunReport> dry_run_pipeline(const TrainConfig& config, int world_size, int rank,
                                           const DryRunOptions& options = {});

}  // namespace hp::train
