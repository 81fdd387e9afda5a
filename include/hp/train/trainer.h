// The trainer: builds the mesh from the config's parallel dims, the model with its plans, the
// optimizer and LR schedule; trains with gradient accumulation and clipping, evaluates on the
// held-out split, checkpoints (async, atomic) and resumes; logs a progress line and JSONL metrics.
//
// Collective: every rank of `world` calls train() with the same config.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/core/error.h"
#include "hp/train/callbacks.h"
#include "hp/train/config.h"
#include "hp/train/pipeline_profile.h"

namespace hp::train {

class MemoryCheckpoints;  // hp/train/memory_checkpoints.h

// Thrown by train() on every rank when a step's loss or gradients are not finite and
// train.on_nonfinite is "stop": the message names the step, the ranks and the parameters.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

// Thrown by train() on a rank whose training ended because another rank raised an error
// (docs/resilience.md#last-words-after-an-error): the message names that rank and its error first.
// hp-train exits with code 4 for it, which tells hprun that the cause is another rank.
class OtherRankError : public Error {
 public:
  using Error::Error;
};

// Thrown by train(), with in-memory checkpoints on (resilience.in_memory_checkpoint_interval), on a
// rank whose training steps ended because another rank stopped answering (its process died, or it
// hangs) while no rank raised an error of its own: its memory still holds what a recovery needs
// (docs/resilience.md#process-level-recovery). A failure while the run starts up or recovers is
// thrown as it is.
class RankLostError : public Error {
 public:
  using Error::Error;
};

struct TrainOptions {
  bool resume = false;  // continue from the latest checkpoint of the run, when there is one
  // With resume: only from a checkpoint saved under this process's hprun job (HP_JOB_DIR); from
  // step 0 when the latest is another run's. hp-train sets it when hprun restarts a job that was not
  // told to resume, whose run directory may still hold an earlier run's checkpoints.
  bool resume_only_this_job = false;
  bool dry_run = false;  // print the plan (mesh, each rank's parameters, estimated memory) and stop
  // With dry_run, > 0: the plan also says whether each rank's peak, grown by the allocator slack
  // (DryRunReport::fits), fits in this much memory per rank.
  double memory_limit_gib = 0.0;
  double allocator_slack = 0.1;
  // With dry_run: what a mixture of experts' routers choose in it, a spec of
  // hp::train::RoutingModel::parse ("balanced", "skewed:S", "histogram:FILE").
  std::string routing = "balanced";
  // With dry_run, not empty: each rank also writes its dry-run report to this directory (made if
  // missing): rank_N.txt (DryRunReport::table), rank_N.json and rank_N_lifetimes.csv.
  std::string report_dir;
  // With dry_run, not empty: a calibration (hp-plan --calibrate's JSON, hp/train/cost_model.h) from
  // which the plan also predicts the step time.
  std::string calibration;
  bool progress = true;  // a progress line on rank 0 (on a terminal; plain log lines otherwise)
  // false: no matmul peak is measured (or read from the cache) and the MFU is 0; for runs that only
  // time the job (hprun --cpu-layout auto's probes), which a peak measurement would slow.
  bool measure_peak = true;
  // Run after the built-in metrics log, on every rank (hp/train/callbacks.h).
  std::vector<std::shared_ptr<Callback>> callbacks;
  // Called, from the watchdog's thread, with its message when this rank made no progress for
  // resilience.watchdog_s (docs/resilience.md#timeouts). Empty: the message goes to stderr and the
  // process ends with exit code 3, since a hung thread cannot be unwound. Ranks that are threads of
  // one process (tests) set something that fails the test instead.
  std::function<void(const std::string& message)> on_hang;
  // Where this rank looks for a stop request after each step's backward: a signal number, 0 for
  // none. Empty: the process's (hp/train/stop.h). Ranks that are threads of one process (tests)
  // can each have their own, as processes do.
  std::function<int()> stop_request;
  // With resilience.in_memory_checkpoint_interval: where this rank keeps its in-memory checkpoints
  // and its buddy's copy. It outlives train(), so that a later train() of the same process, on a
  // world made again after a rank's process died, can recover from it. Null: train() keeps them
  // for its own run only.
  std::shared_ptr<MemoryCheckpoints> memory_checkpoints;
  // Start from the newest step that the ranks hold in memory: in memory_checkpoints, or, for a rank
  // whose memory_checkpoints are new (its process was started again), as its buddy's copy, which
  // the buddy sends. Every rank sets it alike. Instead of resume.
  bool recover_from_memory = false;
};

struct TrainResult {
  int64_t first_step = 0;      // 0, or the step resumed from
  std::vector<double> losses;  // global training loss of each step run here
  std::vector<double> grad_norms;
  int64_t skipped_steps = 0;  // not finite, with train.on_nonfinite: skip
  // Steps run again on an anomaly (resilience.rerun_on_anomaly), by what the rerun said.
  int64_t transient_faults = 0, persistent_anomalies = 0;
  double eval_loss = 0.0;        // at the end
  double unigram_entropy = 0.0;  // of the corpus, in nats: the no-context baseline
  double tokens_per_s = 0.0;     // mean over the steps after the first
  double mfu = 0.0;
  std::string sample;  // greedy continuation of config.sample.prompt
  // The stop request (hp/train/stop.h) the run stopped on, after step first_step + losses.size(),
  // with last words and without the final evaluation and sample; 0 when it ran all its steps.
  int stop_signal = 0;
  // parallel.pp_costs measured: the costs and bubbles of the pipeline's profiled steps (2 and 3).
  std::optional<PipelineProfile> pipeline_profile;
};

// `world` must have been created with world_options(config): train.deterministic decides how its
// reductions associate, which a group fixes when it is created.
TrainResult train(const TrainConfig& config, const comm::ProcessGroup& world, const TrainOptions& options = {});

// `base` with what train() needs of its world group: deterministic = train.deterministic, timeout =
// resilience.collective_timeout_s.
comm::ProcessGroupOptions world_options(const TrainConfig& config, comm::ProcessGroupOptions base = {});

}  // namespace hp::train
