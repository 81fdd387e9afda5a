// The cost model: what a rank's training step does (its work, which a dry run records), what that
// work costs on a machine (a calibration, measured there), and the step time they predict.
//
//   // Once, on the machine, on the ranks a job will run there (every rank calls it):
//   const hp::train::Calibration calibration = hp::train::calibrate(config, world);
//   // Then, for any layout, from its dry run (hp/train/dry_run.h):
//   const auto pipeline = hp::train::dry_run_pipeline(config, world_size, /*rank=*/0);
//   hp::train::estimate_step_time(config, pipeline, calibration).seconds;
//
// Compute: every ATen op (and hp's own kernels, hp/core/kernel_observer.h) has a cost class: its
// op class (hp::op_class), matrix products by dtype ("matmul BFloat16"); and a size: log2 of its
// work, rounded down, where the work of a matrix product is its FLOPs and of anything else the
// bytes of its tensor arguments and results (a view has none). The calibration profiles the
// model's own step on one rank at several micro-batch sizes, run on every rank of the machine at
// once (ranks sharing cores slow each other as in the job), and keeps each class's mean time per
// call at each size: an op costs that time, in proportion to its work (an op of a size the profile
// did not see takes the nearest size's time per unit of work, and no less than the class's
// quickest call). Timing ops costs time of its own, and the framework spends time between ops
// (autograd, the model's code): a scale on the ops' times and a time per op, fitted so that the
// profile's untimed steps take what they measured. Communication: a collective costs a latency plus
// a time per byte this rank puts in, by its name and its group's size, measured at a few sizes on
// groups of each size the machine's ranks allow.
//
// The step: forward, backward and the optimizer, in that order, with their collectives waited for
// where they are issued; a pipeline's forward and backward are its micro-batches' F and B actions,
// played by the schedule simulator (hp/pp/schedule.h) with the send cost of one activation; where
// the ranks share cores, ranks idle in the bubble leave theirs to the busy ones: the step is scaled
// by Calibration::contention of its mean busy ranks (1 - bubble of them).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace hp::comm {
class ProcessGroup;
}

namespace hp::train {

struct TrainConfig;

struct OpWork {
  int64_t calls = 0;
  double work = 0.0;  // FLOPs of matrix products, bytes of the rest
};

struct CollectiveWork {
  int64_t calls = 0;
  double bytes = 0.0;  // this rank's input bytes
};

// The size of an op's work: log2 of it, rounded down; -1 for none.
int work_size(double work);

// Whether a collective is a send or a receive: a pipeline's, which its schedule waits for (the
// others cost Calibration::collective_wait each beyond their lines).
bool is_point_to_point(const std::string& collective);

// What one phase of a step does on one rank: ops by (cost class, size), collectives by (name,
// group size).
struct PhaseWork {
  std::map<std::pair<std::string, int>, OpWork> ops;
  std::map<std::pair<std::string, int>, CollectiveWork> collectives;

  int64_t op_calls() const;
};

// What one rank's training step does: forward (the micro-batches' forwards), backward (their
// backwards, a checkpointed block's recomputation included) and the optimizer (gradient clipping
// and the optimizer's step).
struct StepWork {
  PhaseWork forward, backward, optimizer;
};

struct Calibration {
  // A collective: seconds = latency + per_byte x bytes.
  struct Line {
    double latency = 0.0, per_byte = 0.0;
  };
  // Profiled calls of one class and size: their mean work and seconds.
  struct Point {
    double work = 0.0, seconds = 0.0;
  };
  int ranks = 1;                                        // ranks that ran at once on the machine while it was measured
  int cores = 1;                                        // the CPUs they shared (the calibrating process's affinity)
  int threads_per_rank = 1;                             // each rank's intra-op threads
  std::map<std::string, std::map<int, Point>> compute;  // by cost class, then size
  double compute_scale = 1.0;                           // what the profiled ops' times are multiplied by
  double between_ops = 0.0;                             // seconds of framework time per op
  std::map<std::string, std::map<int, Line>> collectives;  // by name, then group size
  // What a collective costs inside a training step beyond its own time (waiting for the slowest
  // rank, the framework's work around it: DTensor's, FSDP's), and what the trainer spends per step
  // beyond the step's ops (metrics, checks). Fitted from training runs of sharded layouts.
  double collective_wait = 0.0, step_overhead = 0.0;
  // The profile's steps: one rank's, one per micro-batch size, and the sharded layouts' that fit
  // collective_wait: what they are, measured seconds (untimed), predicted.
  struct ProfiledStep {
    std::string layout;
    double seconds = 0.0, predicted = 0.0;
  };
  std::vector<ProfiledStep> profile;

  // The cost of `work` of class `cost_class` and size `size` (a class the calibration did not see:
  // the framework's time per op only); of collectives of `name` on groups of `group_size` (the
  // nearest calibrated size; a name without a line is an error naming it).
  double compute_seconds(const std::string& cost_class, int size, const OpWork& work) const;
  double collective_seconds(const std::string& name, int group_size, const CollectiveWork& work) const;
  double phase_seconds(const PhaseWork& phase) const;
  // How long compute takes when `busy` of the calibration's ranks compute at once, relative to all
  // of them (as they did while it was measured): ranks whose threads outnumber the cores share
  // them, so fewer busy ranks go faster; 1 where the threads fit the cores.
  double contention(double busy) const;

  std::string json() const;
  static Calibration from_json(const std::string& text);  // an error names what is missing or wrong
  static Calibration read(const std::string& path);       // from_json of the file; an error names it
};

struct CalibrateOptions {
  // Micro-batch sizes (rows) profiled; empty: 1, 2, 4, ... up to train.global_batch.
  std::vector<int64_t> rows;
  int warmup_steps = 1, profiled_steps = 4;  // per size and layout (their median counts)
  // Collective sizes (bytes each rank puts in) and repetitions per size.
  std::vector<int64_t> collective_bytes = {4 << 10, 256 << 10, 2 << 20};
  int collective_repeats = 8;
};

// Measures the machine: every rank of `world` runs `config`'s model on one rank (its parallel
// dims all 1; one micro-batch per step, of each size in options.rows) and times its ops; then the
// collectives on groups of every size dividing world's; then trains the model (hp::train::train,
// on the config's data, a few steps) on all of `world` as tp (with sequence parallelism) and as
// dp_shard, where the config allows, for collective_wait and step_overhead. Collective over
// `world`; every rank returns the same calibration (pooled over the ranks).
Calibration calibrate(const TrainConfig& config, const comm::ProcessGroup& world, const CalibrateOptions& options = {});

struct StepTimeEstimate {
  double seconds = 0.0;                       // the step
  double compute = 0.0, communication = 0.0;  // of the slowest rank's phases (pipeline: summed per rank)
  double bubble = 0.0;                        // a pipeline's simulated bubble (0 without pp)
  // Classes of work (with work > 0) the calibration has no timing for, priced at its time per op
  // only: it was measured on other code (an older build, before a kernel existed) or another layout.
  std::set<std::string> unpriced;
  std::string str() const;
};

// What an estimate could not price, for the user: "" when it priced everything.
std::string unpriced_warning(const std::set<std::string>& unpriced);

// The step time of `config`'s layout from the work of its ranks: one rank's without pp, each pipeline
// position's (dry_run_pipeline's order) with.
StepTimeEstimate estimate_step_time(const TrainConfig& config, const std::vector<StepWork>& positions,
                                    const Calibration& calibration);

}  // namespace hp::train
