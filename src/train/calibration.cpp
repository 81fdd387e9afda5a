// Measuring a machine for the cost model (hp/train/cost_model.h): the model's own step on one rank,
// run on every rank at once, and the collectives on groups of each size.
#include <ATen/ATen.h>
#include <sched.h>

#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "hp/comm/init.h"
#include "hp/comm/process_group.h"
#include "hp/core/cpu_threads.h"
#include "hp/core/error.h"
#include "hp/train/callbacks.h"
#include "hp/train/cost_model.h"
#include "hp/train/dry_run.h"
#include "hp/train/trainer.h"
#include "train/layout_step.h"
#include "train/least_squares.h"
#include "train/work_recorder.h"

namespace hp::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Sums `values` over `world` (float64: the same on every rank).
void sum_over(const comm::ProcessGroup& world, std::vector<double>& values) {
  if (values.empty()) return;
  const at::Tensor t = world.all_reduce(at::tensor(values, at::kDouble));
  const double* p = t.data_ptr<double>();
  std::copy(p, p + values.size(), values.begin());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// The profiled calls of one cost class and size, summed.
struct PointSums {
  double calls = 0, work = 0, seconds = 0;
};

// `config` with the parallel dims `dims` (sequence parallelism with tp), or nullopt where the
// config does not allow them on `world_size` ranks.
std::optional<TrainConfig> laid_out(TrainConfig c, const ParallelDims& dims, int world_size) {
  c.parallel = dims;
  c.sequence_parallel = dims.tp > 1;
  if (c.train.global_batch % dims.dp() == 0)  // a micro-batch no larger than a rank's batch
    c.train.micro_batch = std::min(c.train.micro_batch, c.train.global_batch / dims.dp());
  c.loss_parallel = false;
  c.pp_layers_per_stage.clear();
  // The cost model prices native collectives: calibrate those. Without data parallelism there is
  // no gradient reduction to give a dtype (validate refuses one).
  c.comm_settings.gradient_wire = c.comm_settings.tp_wire = "native";
  if (dims.dp() * dims.cp == 1) c.train.mixed_precision_reduce = "fp32";
  try {
    validate(c, world_size);
  } catch (const Error&) {
    return std::nullopt;
  }
  return c;
}

// A measured step and what the calibration's lines give for it before the terms fit_step_terms
// fits: its ops' time (compute lines, at scale 1), its collectives' time (their lines), its ops and
// the collectives it waits for.
struct Observation {
  std::string layout;
  bool trained = false;  // by the trainer, whose own time per step it includes
  double seconds = 0, compute = 0, communication = 0, ops = 0, collectives = 0;
};

// The terms no single measurement gives, fitted over every profiled step at once: the scale on the
// ops' timed seconds (timing costs time of its own), the framework's time per op, the trainer's
// per step, and a collective's wait inside a step: seconds - communication = scale x compute +
// between_ops x ops + step_overhead (trained steps only) + collective_wait x collectives, the scale
// > 0 (1 when no fit has one) and the rest >= 0.
void fit_step_terms(const std::vector<Observation>& observations, Calibration& cal) {
  std::vector<std::vector<double>> X;
  std::vector<double> y;
  for (const Observation& o : observations) {
    X.push_back({o.compute, o.ops, o.trained ? 1.0 : 0.0, o.collectives});
    y.push_back(o.seconds - o.communication);
  }
  std::vector<double> c = detail::nonnegative_least_squares(X, y, /*positive=*/1u);
  if (c.empty()) {
    // No fit with a positive scale: the ops' times as timed, the rest fitted to what they leave.
    std::vector<std::vector<double>> rest;
    std::vector<double> left;
    for (size_t i = 0; i < X.size(); ++i) {
      rest.push_back({X[i][1], X[i][2], X[i][3]});
      left.push_back(y[i] - X[i][0]);
    }
    const std::vector<double> r = detail::nonnegative_least_squares(rest, left);
    c = {1.0, r[0], r[1], r[2]};
  }
  cal.compute_scale = c[0];
  cal.between_ops = c[1];
  cal.step_overhead = c[2];
  cal.collective_wait = c[3];
  for (size_t i = 0; i < observations.size(); ++i)
    cal.profile.push_back(
        {observations[i].layout, observations[i].seconds,
         observations[i].communication + c[0] * X[i][0] + c[1] * X[i][1] + c[2] * X[i][2] + c[3] * X[i][3]});
}

// The model's step on one rank at each size, timed op by op on every rank at once (a timed step,
// then an untimed one, per profiled step): each class's mean call per size, and the scale and the
// framework's time per op that bring the timed ops to the untimed steps' wall time.
void calibrate_compute(const TrainConfig& config, const comm::ProcessGroup& world, const CalibrateOptions& o,
                       Calibration& cal, std::vector<Observation>& observations) {
  std::vector<int64_t> rows = o.rows;
  if (rows.empty())
    for (int64_t r = 1; r <= config.train.global_batch; r *= 2) rows.push_back(r);
  const std::optional<TrainConfig> one_rank = laid_out(config, ParallelDims{}, 1);
  HP_CHECK(one_rank, "calibrate: the config does not run on one rank");
  detail::LayoutStep one(*one_rank, comm::fake_world(1, 0, world_options(*one_rank)), /*micro_batches=*/1);
  std::map<std::pair<std::string, int>, PointSums> points;
  // Per size: the untimed steps' seconds (their median, on this rank), a timed step's ops.
  std::vector<std::vector<double>> untimed_steps(rows.size());
  std::vector<double> wall(rows.size(), 0.0), calls(rows.size(), 0.0);
  std::vector<StepWork> work(rows.size());  // per size: a timed step's work
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int64_t i = 0; i < o.warmup_steps + o.profiled_steps; ++i) {
      const bool profiled = i >= o.warmup_steps;
      world.barrier();  // the ranks run at once, as in the job
      StepWork step_work;
      std::vector<detail::WorkRecorder::Sample> samples;
      {
        detail::WorkRecorder recorder(&step_work, /*timed=*/true);
        const DispatchModeGuard on(recorder);
        const KernelObserverGuard kernels(&recorder);
        one.run(rows[r], &recorder);
        samples = recorder.samples();
      }
      world.barrier();
      const auto start = Clock::now();
      one.run(rows[r]);
      const double untimed = seconds_since(start);
      if (!profiled) continue;
      untimed_steps[r].push_back(untimed);
      calls[r] = static_cast<double>(samples.size());
      for (const auto& sample : samples) {
        PointSums& p = points[{sample.cost_class, work_size(sample.work)}];
        p.calls += 1;
        p.work += sample.work;
        p.seconds += sample.seconds;
      }
      work[r] = step_work;
    }
    wall[r] = median(untimed_steps[r]);
  }
  // Pooled over the ranks: every rank ran the same ops, so the keys agree (their hash, the same
  // on every rank, checks it before the sums are matched key by key).
  std::string joined;
  for (const auto& [key, p] : points) joined += key.first + "@" + std::to_string(key.second) + ";";
  const double hash = static_cast<double>(std::hash<std::string>{}(joined) % (1ULL << 50));
  std::vector<double> hashes = {hash, -hash};
  sum_over(world, hashes);  // the sum of the hashes and of their negatives: n x hash each when all agree
  HP_CHECK(hashes[0] == hash * world.size() && hashes[1] == -hash * world.size(),
           "calibrate: the ranks ran different ops in the same steps");
  std::vector<double> sums(wall);
  sums.insert(sums.end(), calls.begin(), calls.end());
  for (const auto& [key, p] : points) sums.insert(sums.end(), {p.calls, p.work, p.seconds});
  sum_over(world, sums);
  size_t at = 2 * rows.size();
  for (const auto& [key, p] : points) {
    const double n = sums[at];
    cal.compute[key.first][key.second] = {sums[at + 1] / n, sums[at + 2] / n};
    at += 3;
  }
  const double ranks = static_cast<double>(world.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    Observation step{"one rank, " + std::to_string(rows[r]) + " rows", /*trained=*/false, sums[r] / ranks};
    step.ops = sums[rows.size() + r] / ranks;
    for (const PhaseWork* phase : {&work[r].forward, &work[r].backward, &work[r].optimizer})
      step.compute += cal.phase_seconds(*phase);  // scale 1, nothing between ops yet; no collectives
    observations.push_back(step);
  }
}

// The seconds of the steps after the first two of a training run (hp::train::train).
struct StepSeconds : Callback {
  std::vector<double> seconds;
  void on_step_end(const StepRecord& record) override {
    if (record.step > 2) seconds.push_back(record.seconds);
  }
};

// The model trained by the trainer on all of `world` as tp (with sequence parallelism) and as
// dp_shard, where the config allows: their steps' median seconds, and what the lines give for
// them (their dry run's work). The runs use the config's data and write to a directory of their
// own, removed after.
void calibrate_in_training(const TrainConfig& config, const comm::ProcessGroup& world, const CalibrateOptions& o,
                           const Calibration& cal, std::vector<Observation>& observations) {
  const int n = world.size();
  ParallelDims tp, dp_shard;
  tp.tp = dp_shard.dp_shard = n;
  const std::string run_dir =
      (std::filesystem::temp_directory_path() / ("hp-plan-calibration-" + std::to_string(getpid()))).string();
  for (const auto& [name, dims] : {std::pair<const char*, ParallelDims>{"tp", tp}, {"dp_shard", dp_shard}}) {
    std::optional<TrainConfig> c = laid_out(config, dims, n);
    if (!c) continue;
    c->train.steps = 2 + o.warmup_steps + o.profiled_steps;
    c->schedule.warmup_steps = std::min(c->schedule.warmup_steps, c->train.steps);
    c->eval.interval = c->checkpoint.interval = c->sample.tokens = 0;
    c->run_dir = run_dir;
    Observation step{std::string(name) + " " + std::to_string(n) + ", micro_batch " +
                         std::to_string(c->train.micro_batch) + " (trained)",
                     /*trained=*/true};
    const StepWork work = dry_run_pipeline(*c, n, 0).front().work;  // rank 0's; the ranks are alike
    const StepTimeEstimate lines = estimate_step_time(*c, {work}, cal);
    step.compute = lines.compute;
    step.communication = lines.communication;
    for (const PhaseWork* phase : {&work.forward, &work.backward, &work.optimizer}) {
      step.ops += static_cast<double>(phase->op_calls());
      for (const auto& [key, w] : phase->collectives)
        if (!is_point_to_point(key.first)) step.collectives += static_cast<double>(w.calls);
    }
    auto seconds = std::make_shared<StepSeconds>();
    TrainOptions options;
    options.progress = false;
    options.callbacks = {seconds};
    train(*c, world, options);
    std::vector<double> measured(seconds->seconds.begin() + std::min<size_t>(o.warmup_steps, seconds->seconds.size()),
                                 seconds->seconds.end());
    std::vector<double> medians = {median(measured)};
    sum_over(world, medians);
    step.seconds = medians[0] / n;  // the ranks' mean
    observations.push_back(step);
  }
  std::error_code ignored;
  std::filesystem::remove_all(run_dir, ignored);
}

// A tensor of about `bytes` whose rows split evenly over `group_size` ranks (float32).
at::Tensor message(int64_t bytes, int group_size) {
  const int64_t rows = std::max<int64_t>(1, bytes / 4 / 64 / group_size) * group_size;
  return at::ones({rows, 64}, at::kFloat);
}

// One collective of `name` on `group` with a message of about `bytes`; the bytes this rank puts in.
int64_t run_collective(const std::string& name, const comm::ProcessGroup& group, int64_t bytes) {
  if (name == "barrier") {
    group.barrier();
    return 0;
  }
  const int g = group.size();
  at::Tensor t = message(bytes, g);
  if (name == "all_reduce") group.all_reduce(t);
  if (name == "all_gather") t = t.narrow(0, 0, t.size(0) / g).contiguous(), group.all_gather(t);
  if (name == "reduce_scatter") group.reduce_scatter(t);
  if (name == "all_to_all") group.all_to_all(t);
  if (name == "broadcast") group.broadcast(t, 0);
  return static_cast<int64_t>(t.nbytes());
}

// Group ranks 0 and 1 pass a message back and forth: one way's time is a send's (a pipeline's
// stages wait for it).
int64_t ping_pong(const comm::ProcessGroup& group, int64_t bytes) {
  at::Tensor t = message(bytes, 1);
  if (group.rank() == 0) {
    group.send(t, 1);
    group.recv(t, 1);
  } else if (group.rank() == 1) {
    group.recv(t, 0);
    group.send(t, 0);
  }
  return static_cast<int64_t>(t.nbytes());
}

void calibrate_collectives(const comm::ProcessGroup& world, const CalibrateOptions& o, Calibration& cal) {
  const std::vector<std::string> names = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                          "barrier",    "send"};
  for (int g = 2; g <= world.size(); ++g) {
    if (world.size() % g != 0) continue;
    std::vector<int> ranks(g);
    for (int i = 0; i < g; ++i) ranks[i] = world.rank() / g * g + i;
    const comm::ProcessGroup group = world.new_group(ranks, "calibrate_" + std::to_string(g));
    for (const std::string& name : names) {
      // Per size: this rank's bytes and mean seconds per call (a send: half a round trip).
      std::vector<double> points;
      for (int64_t bytes : o.collective_bytes) {
        const auto once = [&] { return name == "send" ? ping_pong(group, bytes) : run_collective(name, group, bytes); };
        once();
        world.barrier();
        const auto start = Clock::now();
        int64_t put = 0;
        for (int i = 0; i < o.collective_repeats; ++i) put = once();
        const double each = seconds_since(start) / o.collective_repeats / (name == "send" ? 2 : 1);
        const bool measured = name != "send" || group.rank() < 2;
        points.insert(points.end(),
                      {measured ? static_cast<double>(put) : 0.0, measured ? each : 0.0, measured ? 1.0 : 0.0});
      }
      sum_over(world, points);
      // seconds = latency + per_byte x bytes through every size, both >= 0, each size's error
      // relative to its time (the small messages' latency counts as much as the large ones' bytes).
      std::vector<std::vector<double>> X;
      std::vector<double> y;
      for (size_t i = 0; i < o.collective_bytes.size(); ++i) {
        const double seconds = points[3 * i + 1] / points[3 * i + 2];
        X.push_back({1.0 / seconds, points[3 * i] / points[3 * i + 2] / seconds});
        y.push_back(1.0);
      }
      const std::vector<double> c = detail::nonnegative_least_squares(X, y);
      const Calibration::Line line{c[0], c[1]};
      cal.collectives[name][g] = line;
      if (name == "send") cal.collectives["recv"][g] = Calibration::Line{};  // the send's time is the pair's
    }
  }
}

}  // namespace

Calibration calibrate(const TrainConfig& config, const comm::ProcessGroup& world, const CalibrateOptions& options) {
  HP_CHECK(options.warmup_steps >= 0 && options.profiled_steps >= 1 && options.collective_repeats >= 1 &&
               !options.collective_bytes.empty(),
           "calibrate: needs at least one profiled step, one repeat and one collective size");
  for (int64_t r : options.rows) HP_CHECK(r >= 1, "calibrate: rows must be >= 1, got ", r);
  Calibration cal;
  cal.ranks = world.size();
  cal.threads_per_rank = cpu_threads();
  cpu_set_t cpus;
  cal.cores = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  std::vector<Observation> observations;
  calibrate_compute(config, world, options, cal, observations);
  calibrate_collectives(world, options, cal);
  calibrate_in_training(config, world, options, cal, observations);
  fit_step_terms(observations, cal);
  return cal;
}

}  // namespace hp::train
