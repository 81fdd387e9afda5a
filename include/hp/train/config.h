// The training configuration: one YAML file plus `key=value` overrides. Every key is known (an
// unknown one is an error naming it), and validate() refuses inconsistent settings with a message
// that says what to change, before any work starts. docs/training.md is the reference.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/types.h"
#include "hp/models/registry.h"
#include "hp/parallel/parallel_dims.h"
#include "hp/pp/schedule.h"

namespace hp::train {

struct TrainConfig {
  std::string run_dir = "runs/default";  // metrics.jsonl, loss.svg, checkpoints/
  uint64_t seed = 0;

  // model.family and the family's model.* keys (hp/models/registry.h); `model->` is its ModelSpec.
  models::ModelConfig model;
  // model.from_hf: a Hugging Face model directory. Its config.json gives model.family and the
  // architecture keys (a key also set here must agree), and a run that does not resume starts from
  // its safetensors weights, each rank reading only its pieces. Empty: weights drawn from the seed.
  std::string model_from_hf;

  ParallelDims parallel;
  bool sequence_parallel = false;
  bool loss_parallel = false;
  bool async_tp = false;  // TP's gathers and reduce-scatters fused with its matmuls (needs sequence_parallel)
  bool reshard_after_forward = true;
  int64_t reshard_after_forward_to = 0;      // FSDP2's integer form: keep 1/k after forward (0: all ranks)
  std::string pp_schedule = "1f1b";          // gpipe | 1f1b | interleaved | zbv | zbh1 | zbh2 (pp > 1)
  int64_t pp_stages_per_rank = 2;            // interleaved only
  std::vector<int64_t> pp_layers_per_stage;  // layers of each pipeline stage, in stage order; empty: equal
  std::string cp_mode = "ring";              // ring | allgather | ulysses | hybrid (cp > 1)
  int64_t cp_ulysses = 0;                    // hybrid: the ranks of each Ulysses group
  bool cp_async = false;                     // each layer's K and V start moving as soon as computed
  // What the zero-bubble schedules (zbv, zbh1, zbh2) are ordered for: "measured" (step 2 runs the
  // unit-cost order and measures F, I, W, send and overhead; from step 3 the order built for them
  // runs when it predicts at least 5% less bubble), "unit", or "F,I,W" / "F,I,W,send" (relative
  // costs).
  std::string pp_costs = "measured";
  int64_t pp_timeline_step = 0;  // > 0: draw that step's measured pipeline timeline (run_dir/pp_timeline.svg)

  struct Data {
    std::vector<std::string> sources = {"/usr/share/games/fortunes"};
    std::string cache_dir = "data/fortunes";
    double eval_fraction = 0.05;
    int64_t seq_len = 128;
  } data;

  struct Train {
    int64_t steps = 100;
    int64_t global_batch = 16;   // sequences per optimizer step, over all data-parallel ranks
    int64_t micro_batch = 16;    // sequences per forward/backward on one rank (gradient accumulation below it)
    double max_grad_norm = 1.0;  // 0 = no clipping
    // Bitwise-reproducible results that do not depend on the data-parallel degree (docs/training.md).
    bool deterministic = true;
    int64_t cpu_threads = 0;  // intra-op CPU threads per rank; 0 = as launched (hprun: cores / ranks)
    // A step whose loss or gradients are not finite: "stop" (the run fails naming where, the last
    // checkpoint stays as it was) or "skip" (no optimizer step; the run goes on).
    std::string on_nonfinite = "stop";
    // The dtype forward and backward compute in ("fp32" or "bf16"), through FSDP's mixed precision
    // (units of one rank when there is no data parallelism); parameters, optimizer state and the
    // logits stay fp32. mixed_precision_reduce: the dtype gradients are reduced in across ranks.
    std::string dtype = "fp32";
    std::string mixed_precision_reduce = "fp32";
    // Where the model trains: "cpu", or "cuda" (a build with HP_CUDA=ON; the rank's GPU is
    // LOCAL_RANK % the GPUs it sees; one rank and the llama family for now, docs/gpu.md).
    std::string device = "cpu";
  } train;

  struct Memory {
    // Activation checkpointing of every block: "none", "full" (keep only each block's input and
    // recompute the rest in backward) or "selective" (also keep the outputs the default policy
    // saves: every other matrix product and the attention probabilities); docs/memory.md.
    std::string checkpoint = "none";
    // Activation swap of every block: "none"; "host" (each block's activations wait for its
    // backward in a host pool outside the compute allocator, reloaded swap_prefetch blocks ahead);
    // or "file" (they wait in an unnamed file in swap_dir, which the process's resident memory does
    // not hold). Not with checkpoint (swap takes its place).
    std::string swap = "none";
    int64_t swap_prefetch = 1;
    std::string swap_dir;  // the file tier's directory, on a disk; default: run_dir
    // Parameter offload of the FSDP units offload_units names, every one by default (FSDP units of
    // one rank without data parallelism):
    // "none"; "host" (sharded parameters, their gradients and optimizer state live in host memory
    // outside the compute allocator); or "file" (in an unnamed file in offload_dir, mapped, written
    // back and dropped from memory after each use and read ahead before the next); docs/memory.md.
    std::string offload = "none";
    std::string offload_dir;  // the file tier's directory, on a disk; default: run_dir
    // The units offload applies to, as patterns of unit names (models::RecipeOptions::offload_units):
    // "root", "layers.3", "layers.*.mlp.experts", "stage.1"; empty: every unit.
    std::vector<std::string> offload_units;
    // Offload: how many blocks ahead the units gather and read their shards in (0: each at its use).
    int64_t offload_prefetch = 1;
    // What each block keeps for backward, one entry per model layer in layer order: "none", "full",
    // "selective" or "swap" (to swap's tier, which swap names: host or file), in place of checkpoint
    // and swap's every block. Empty: as checkpoint and swap say.
    std::vector<std::string> blocks;
    // N > 0: the automatic strategy chooses `blocks` (among none, full, selective, and swap where
    // swap names a tier) for the fastest step whose peak, predicted by dry runs, stays under N MiB
    // per rank, from the costs a profiled step measures; docs/memory.md.
    int64_t budget_mb = 0;
  } memory;

  struct Optimizer {
    std::string name = "adamw";  // "adamw", or "muon" (Muon for block matrices + AdamW for the rest)
    double lr = 1e-3, weight_decay = 0.0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
    double muon_lr = 0.02, muon_momentum = 0.95;
  } optimizer;

  struct Schedule {
    std::string decay = "cosine";  // cosine | linear | wsd | constant
    int64_t warmup_steps = 0;
    double min_lr_ratio = 0.1;
    double decay_fraction = 0.1;  // wsd only
  } schedule;

  struct Checkpoint {
    int64_t interval = 0;  // steps between checkpoints; 0 = none
    std::string dir;       // default: <run_dir>/checkpoints
    bool async = true;
    int64_t keep = 2;  // most recent checkpoints kept
  } checkpoint;

  struct Eval {
    int64_t interval = 0;  // 0 = only at the end
    int64_t batches = 2;
  } eval;

  struct Log {
    int64_t interval = 1;
    // N > 0: rank 0 times step N's ATen ops by op and class of op and writes run_dir/profile.txt.
    int64_t profile_step = 0;
  } log;

  // How long a failure may take to be noticed (docs/resilience.md#timeouts). A collective waits
  // collective_timeout_s for its peers, then fails naming the missing ranks (2 s more); a rank that
  // makes no progress (no step begins or ends, no evaluation batch, save or sampled token) for
  // watchdog_s exits with code 3, which hprun --max-restarts restarts. watchdog_s 0: derived, the larger of
  // collective_timeout_s + 60 and 10x the slowest step so far.
  // replica_check_interval N > 0: every N steps the ranks compare a hash of each parameter shard,
  // and of its optimizer state, with its replicas' (silent data corruption, docs/resilience.md#silent-data-corruption);
  // a mismatch is named and then, by on_replica_mismatch, stops the run or is logged.
  struct Resilience {
    int64_t collective_timeout_s = 300;
    int64_t watchdog_s = 0;
    int64_t replica_check_interval = 0;
    std::string on_replica_mismatch = "stop";  // stop | warn
    // rerun_on_anomaly: a step whose loss or gradient norm is not finite, or more than spike_factor
    // (> 1; 0: off) times the largest of the previous 10 steps' values, runs again from its start.
    // The same numbers again, or an anomaly again: persistent, the data or the model (the step
    // goes on, or by train.on_nonfinite when not finite); other numbers: a transient fault of the
    // hardware, and by on_transient_fault the run goes on with the rerun's step or stops with last
    // words (docs/resilience.md#rerun-on-anomaly). On cuda it needs train.deterministic.
    bool rerun_on_anomaly = false;
    // Every N steps (0: never) each rank copies its state (its shards of the parameters and optimizer
    // state, the step, the RNG positions) to its host memory and sends the copy to its buddy, the next
    // world rank, which keeps it: under hprun --recover-processes a rank whose process dies is started
    // again alone and takes its state back from its buddy, while the others keep their processes and
    // go back to their own copies (docs/resilience.md#process-level-recovery).
    int64_t in_memory_checkpoint_interval = 0;
    double spike_factor = 0.0;
    std::string on_transient_fault = "continue";  // continue | stop
    // Faults to inject, for drills: KIND:RANK:STEP[:ARG] separated by commas, as the environment's
    // HP_FAULT lists them (docs/resilience.md#fault-injection); both lists fire.
    std::string faults;
  } resilience;

  // How collectives move data between ranks (docs/collectives.md#transports): auto (shared memory
  // for the groups that can set it up, else Gloo), gloo, or shm (shared memory between the ranks of
  // a host, Gloo across hosts).
  // gradient_wire: the format gradients travel in between data-parallel ranks: native (the
  // dtype of train.mixed_precision_reduce), bf16 or fp8_e4m3, added in fp32
  // (docs/collectives.md#low-precision-reductions). tp_wire: the same for the reductions of tensor
  // parallelism's layers, activations and their gradients (docs/tensor_parallel.md).
  struct Comm {
    std::string transport = "auto";
    std::string gradient_wire = "native";
    std::string tp_wire = "native";
  } comm_settings;

  struct Sample {
    std::string prompt = "The ";
    int64_t tokens = 0;  // greedy-generated at the end; 0 = none
  } sample;

  std::string checkpoint_dir() const { return checkpoint.dir.empty() ? run_dir + "/checkpoints" : checkpoint.dir; }
  int64_t per_rank_batch() const { return train.global_batch / parallel.dp(); }
  int64_t micro_batches() const { return per_rank_batch() / train.micro_batch; }
  // Pipeline stages over all pp ranks for pp_schedule (0 for an unknown schedule name).
  int64_t pipeline_stages() const { return pp::schedule_stages(pp_schedule, parallel.pp, pp_stages_per_rank); }
};

// Parses `yaml` (`source` names it in errors), then applies each "dotted.key=value" override.
TrainConfig parse_config(const std::string& yaml, const std::vector<std::string>& overrides,
                         const std::string& source = "<config>");
TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Throws hp::Error with the documented message for the first problem found (world size, divisibility,
// batch split, sequence length, vocabulary, unknown names).
void validate(const TrainConfig& config, int64_t world_size);

// comm.transport as the world group's transport (hp::train::world_options applies it).
comm::Transport transport_of(const TrainConfig& config);
// comm.gradient_wire as the FSDP units' reduce_wire.
comm::WireFormat gradient_wire_of(const TrainConfig& config);
// comm.tp_wire as the tensor-parallel plan's wire.
comm::WireFormat tp_wire_of(const TrainConfig& config);

// The whole configuration as a JSON string (every key, defaults included).
std::string to_json(const TrainConfig& config);

}  // namespace hp::train
