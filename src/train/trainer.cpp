#include "hp/train/trainer.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>

#include "hp/comm/init.h"
#include "hp/comm/leave.h"
#include "hp/core/cpu_threads.h"
#include "hp/core/error.h"
#include "hp/core/job.h"
#include "hp/core/libtorch_version.h"
#include "hp/core/log.h"
#include "hp/core/memory_tracker.h"
#include "hp/core/storage_tier.h"
#include "hp/data/text_data.h"
#include "hp/dtensor/local.h"
#include "hp/dtensor/random.h"
#include "hp/models/model_spec.h"
#include "hp/nn/token_coordinates.h"
#include "hp/optim/adamw.h"
#include "hp/optim/chained.h"
#include "hp/optim/clip_grad.h"
#include "hp/optim/lr_scheduler.h"
#include "hp/optim/muon.h"
#include "hp/parallel/context_parallel.h"
#include "hp/parallel/parallel_dims.h"
#include "hp/train/memory_checkpoints.h"
#include "hp/train/stop.h"
#include "hp/train/train_step.h"
#include "train/checkpointing.h"
#include "train/device_memory.h"
#include "train/error_account.h"
#include "train/fault_injector.h"
#include "train/generation.h"
#include "train/hf_weights.h"
#include "train/job_peak.h"
#include "train/job_progress.h"
#include "train/lead_first.h"
#include "train/memory_budget.h"
#include "train/memory_checkpointing.h"
#include "train/metrics_callback.h"
#include "train/plan.h"
#include "train/recipe_options.h"
#include "train/replica_check.h"
#include "train/setup.h"
#include "train/step_health.h"
#include "train/step_profile.h"
#include "train/step_rerun.h"
#include "train/stop_internal.h"
#include "train/watchdog.h"

namespace hp::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The world mean of a per-rank value (ranks of one tensor-parallel group hold the same value, so
// this is the data-parallel mean).
double world_mean(double value, const comm::ProcessGroup& world) {
  at::Tensor t = at::scalar_tensor(value, at::kDouble).reshape({1});
  world.all_reduce(t, {comm::ReduceOp::kAvg});
  return t.item<double>();
}

LRScheduler make_scheduler(const TrainConfig& c, torch::optim::Optimizer& optimizer) {
  LRSchedule schedule;
  schedule.warmup_steps = c.schedule.warmup_steps;
  schedule.total_steps = c.train.steps;
  schedule.decay = parse_decay(c.schedule.decay);
  schedule.min_lr_ratio = c.schedule.min_lr_ratio;
  schedule.decay_fraction = c.schedule.decay_fraction;
  return get_hyper_lr_scheduler(optimizer, schedule);
}

// Bitwise-repeatable GPU runs, while any run in the process needs them (runs may overlap: ranks as
// threads); the process's setting comes back after the last: ATen's deterministic kernels, and
// cuBLAS with a fixed workspace (read when cuBLAS starts, so before the first matmul; a value the
// user set stays).
class DeterministicKernels {
 public:
  DeterministicKernels() {
    std::lock_guard<std::mutex> lock(mu_);
    if (users_++ > 0) return;
    was_ = at::globalContext().deterministicAlgorithms();
    was_warn_only_ = at::globalContext().deterministicAlgorithmsWarnOnly();
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  }
  ~DeterministicKernels() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--users_ == 0) at::globalContext().setDeterministicAlgorithms(was_, was_warn_only_);
  }
  DeterministicKernels(const DeterministicKernels&) = delete;
  DeterministicKernels& operator=(const DeterministicKernels&) = delete;

 private:
  static inline std::mutex mu_;
  static inline int users_ = 0;
  static inline bool was_ = false, was_warn_only_ = false;
};

// What MFU divides by, logged with where the number comes from; 0 (no MFU) when measuring fails,
// which costs the run its MFU, nothing else. Rank 0 measures while the others wait.
double report_peak(const TrainConfig& c, const models::ModelParts& parts, int64_t world_size) {
  try {
    const PeakFlops peak = detail::job_peak_flops(c, parts, world_size);
    log::info("MFU against a ", dtype_name(peak.dtype), " matmul peak of ", static_cast<int64_t>(peak.flops / 1e9),
              " GFLOP/s (", peak.source, ")");
    return peak.flops;
  } catch (const std::exception& e) {
    log::warn("no MFU: measuring the matmul peak failed: ", e.what());
    return 0.0;
  }
}

// The training and held-out token streams: rank 0 prepares the token files, the others wait and
// read them.
struct Data {
  data::CorpusInfo corpus;
  data::TokenSampler train, eval;
};

Data load_data(const TrainConfig& c, const comm::ProcessGroup& world) {
  detail::lead_first(world, "preparing the data",
                     [&] { data::prepare_corpus(c.data.sources, c.data.cache_dir, c.data.eval_fraction); });
  data::CorpusInfo corpus = data::prepare_corpus(c.data.sources, c.data.cache_dir, c.data.eval_fraction);
  data::TokenSampler train(data::load_tokens(corpus.train_path), c.data.seq_len, c.seed);
  data::TokenSampler eval(data::load_tokens(corpus.eval_path), c.data.seq_len, c.seed);
  return {std::move(corpus), std::move(train), std::move(eval)};
}

}  // namespace

comm::ProcessGroupOptions world_options(const TrainConfig& config, comm::ProcessGroupOptions base) {
  return base.set_deterministic(config.train.deterministic)
      .set_timeout(std::chrono::seconds(config.resilience.collective_timeout_s))
      .set_transport(transport_of(config));
}

TrainResult train(const TrainConfig& c, const comm::ProcessGroup& world, const TrainOptions& options) {
  validate(c, world.size());
  HP_CHECK(!comm::is_fake(world), "train: the world group is a fake world (hp::comm::fake_world), whose collectives ",
           "move no data; train on a real one (init_process_group), or use hp::train::dry_run");
  HP_CHECK(world.options().deterministic == c.train.deterministic, "train.deterministic is ",
           c.train.deterministic ? "true" : "false", " but the world group was created ",
           world.options().deterministic ? "deterministic" : "not deterministic",
           ": create it with hp::train::world_options(config)");
  HP_CHECK(world.options().timeout == std::chrono::seconds(c.resilience.collective_timeout_s),
           "resilience.collective_timeout_s is ", c.resilience.collective_timeout_s,
           " s but the world group's timeout is ", world.options().timeout.count(),
           " ms: create it with hp::train::world_options(config)");
  HP_CHECK(world.options().transport == transport_of(c), "comm.transport is ", c.comm_settings.transport,
           " but the world group's transport is ", comm::to_string(world.options().transport),
           ": create it with hp::train::world_options(config)");
  std::optional<CpuThreadsGuard> threads;
  if (c.train.cpu_threads > 0) threads.emplace(static_cast<int>(c.train.cpu_threads));
  log::LogRankGuard log_rank(world.rank());
  const bool lead = world.rank() == 0;
  if (lead && c.train.dtype == "fp32" && cpu_threads() > 1 && std::getenv("OMP_WAIT_POLICY") == nullptr)
    log::warn("fp32 on ", cpu_threads(), " threads per rank with OpenMP's default (spinning) wait: OpenBLAS's ",
              "threads wait for the cores; OMP_WAIT_POLICY=PASSIVE in the environment ran 3.5x faster on one rank of ",
              "2 threads (docs/performance.md)");
  HP_CHECK(std::isfinite(options.memory_limit_gib) && options.memory_limit_gib >= 0.0 &&
               std::isfinite(options.allocator_slack) && options.allocator_slack >= 0.0,
           "train: TrainOptions::memory_limit_gib (", options.memory_limit_gib, ") and allocator_slack (",
           options.allocator_slack, ") must be finite and >= 0");
  HP_CHECK(options.dry_run ||
               (options.routing == TrainOptions{}.routing && options.report_dir.empty() && options.calibration.empty()),
           "train: TrainOptions::routing, report_dir and calibration are for a dry run; set dry_run");
  HP_CHECK(
      !options.recover_from_memory || c.resilience.in_memory_checkpoint_interval > 0,
      "train: TrainOptions::recover_from_memory needs in-memory checkpoints (resilience.in_memory_checkpoint_interval "
      "> 0)");
  HP_CHECK(!options.recover_from_memory || !options.dry_run, "train: a dry run recovers nothing");
  // The automatic memory strategy: the run goes on with the blocks it chose (a dry run shows them).
  if (c.memory.budget_mb > 0) return train(detail::with_memory_plan(c, world), world, options);
  if (options.dry_run) {
    const detail::Setup s = detail::build(c, world);
    detail::print_plan(c, world, s.mesh, s.parts, options);
    return {};
  }

  // First, while the world's collectives surely work: it agrees on this run's number.
  const detail::ErrorAccounting error_accounting(world);
  peak_flops_override();  // a bad HP_PEAK_FLOPS fails every rank alike, before any waits for rank 0
  const auto faults = detail::injected_faults(c.resilience.faults, world.size(), c.train.steps);
  const Data data = load_data(c, world);
  MemoryTracker memory;
  std::optional<DeterministicKernels> deterministic_kernels;
  if (c.train.device == "cuda" && c.train.deterministic) deterministic_kernels.emplace();
  detail::Setup s = detail::build(c, world);
  s.parts.init_parameters(c.seed, s.mesh.device());  // a pipeline rank: only its stages
  double peak = 0.0;
  if (options.measure_peak)
    detail::lead_first(world, "measuring the peak FLOP/s", [&] { peak = report_peak(c, s.parts, world.size()); });
  const std::unique_ptr<torch::optim::Optimizer> optimizer = detail::make_optimizer(c, s.parts, s.parts.parameters());
  LRScheduler scheduler = make_scheduler(c, *optimizer);
  detail::Checkpointing checkpoints(c, s.mesh, s.parts, *optimizer, world);
  // Kept in the caller's MemoryCheckpoints when it gives some, so that they outlive this run.
  const std::shared_ptr<MemoryCheckpoints> memory_checkpoints =
      options.memory_checkpoints ? options.memory_checkpoints : std::make_shared<MemoryCheckpoints>();
  const int64_t memory_interval = c.resilience.in_memory_checkpoint_interval;
  std::optional<detail::MemoryCheckpointing> in_memory;
  if (memory_interval > 0) in_memory.emplace(*memory_checkpoints, world);
  TrainStepOptions step_options;
  step_options.micro_batches = c.micro_batches();
  step_options.deterministic = c.train.deterministic;
  step_options.timeline_step = c.pp_timeline_step;
  step_options.timeline_path = c.run_dir + "/pp_timeline.svg";
  step_options.lead = lead;
  step_options.schedule_for_measured_costs =
      c.parallel.pp > 1 && pp::orders_for_costs(c.pp_schedule) && c.pp_costs == "measured";
  step_options.schedule_name = c.pp_schedule;
  step_options.stages_per_rank = static_cast<int>(c.pp_stages_per_rank);
  step_options.world = world;
  TrainStep train_step(s.parts, step_options);
  const std::vector<at::Tensor> counted = s.parts.counted_parameters(), copies = s.parts.copied_parameters();
  const int64_t rows = c.per_rank_batch(), first_row = s.dp_rank * rows;

  TrainResult result;
  result.unigram_entropy = data.corpus.unigram_entropy_nats;
  // Every rank back at the step all of them hold in memory.
  const auto recover_from_memory = [&]() {
    const detail::MemoryCheckpointing::Recovered back =
        in_memory->recover([&](int64_t recovered) { return detail::damages_copy(faults, world.rank(), recovered); });
    const int64_t recovered = checkpoints.restore_packed(back.packed, scheduler);
    HP_CHECK(recovered == back.step, "process-level recovery: the state of step ", back.step, " says step ", recovered);
    if (lead) log::info("recovered at step ", recovered, " from the ranks' in-memory checkpoints");
    return recovered;
  };
  int64_t step = result.first_step = options.recover_from_memory ? recover_from_memory()
                                     : options.resume ? checkpoints.resume(scheduler, options.resume_only_this_job)
                                                      : 0;
  if (step == 0 && !c.model_from_hf.empty() && !options.recover_from_memory) {
    detail::load_hf_weights(s.parts, c.model_from_hf);
    if (lead) log::info("weights from the Hugging Face model in ", c.model_from_hf);
  }
  // The step the run starts from (0, resumed, recovered) is held in memory, its copies arrived,
  // before the first step: a failure before the next in-memory checkpoint goes back to it.
  // A run that does not recover starts its memory afresh (an earlier run's steps are not its own).
  // Every rank is past this before rank 0 reports the run started (hprun recovers a rank's process
  // only then).
  if (in_memory) {
    if (!options.recover_from_memory) in_memory->start_over();
    in_memory->keep(step, checkpoints.pack(step, scheduler));
    in_memory->finish_exchange();
    world.barrier();
  }
  // First, so that a callback stuck in an event is caught too.
  const auto watchdog = std::make_shared<detail::Watchdog>(world.rank(), std::chrono::seconds(c.resilience.watchdog_s),
                                                           world.options().timeout, options.on_hang);
  if (lead) log::info("timeouts: ", watchdog->describe());
  std::vector<std::shared_ptr<Callback>> callbacks{watchdog};
  if (lead)
    callbacks.push_back(std::make_shared<detail::MetricsCallback>(
        c, detail::RunFacts{world.size(), data.corpus.unigram_entropy_nats,
                            options.resume || options.recover_from_memory, options.progress}));
  if (lead)
    if (auto progress = detail::job_progress()) callbacks.push_back(progress);
  callbacks.insert(callbacks.end(), options.callbacks.begin(), options.callbacks.end());
  // Last, so that every other callback has seen the step a fault ends.
  for (auto& fault : detail::fault_callbacks(faults, world.rank(), s.parts, *optimizer)) callbacks.push_back(fault);
  const auto notify = [&](const auto& call) {
    for (const auto& callback : callbacks) call(*callback);
  };
  const auto evaluate = [&]() {
    double sum = 0.0;
    for (int64_t b = 0; b < c.eval.batches; ++b) {
      watchdog->progress("evaluating batch " + std::to_string(b + 1) + " of " + std::to_string(c.eval.batches));
      auto [x, y] = data.eval.eval_batch(b, c.train.global_batch, first_row, rows);
      sum += train_step.evaluate(s.shard_sequence(x), s.shard_sequence(y));
    }
    return world_mean(sum / static_cast<double>(c.eval.batches), world);
  };

  // Every replica_check_interval steps, before every save (a save writes one replica of each shard,
  // which must not be a corrupt one: last words too), and before committing a save that staged in
  // the background during this step (a replica corrupted since the last check may be in it; a stop
  // abandons it uncommitted).
  int64_t replica_checks = 0;
  double replica_check_seconds = 0.0;
  // Set where every rank ends the run together, having decided what to save: the error that follows
  // needs no last words after it.
  bool agreed_end = false;
  const auto check_replicas_if_due = [&](int64_t done, bool saving_last_words) {
    const int64_t every = c.resilience.replica_check_interval;
    const bool saving = saving_last_words || (c.checkpoint.interval > 0 && done % c.checkpoint.interval == 0) ||
                        checkpoints.save_pending();
    if (every <= 0 || (done % every != 0 && !saving)) return;
    const auto t0 = Clock::now();
    const detail::ReplicaReport report = detail::check_replicas(s.parts, optimizer.get(), world);
    replica_check_seconds += seconds_since(t0), ++replica_checks;
    if (lead && replica_checks == 1) {
      if (report.replicated_shards == 0)
        log::warn(
            "resilience.replica_check_interval: no parameter shard has a replica in this layout (replicas come "
            "from dp_replicate and tp): the checks compare nothing");
      else
        log::info("replica checks compare ", report.replicated_shards,
                  " shards (parameters and their optimizer state) held by several ranks");
    }
    if (report.mismatches.empty()) return;
    const std::string what =
        hp::detail::str_cat("replicas of a parameter or of its optimizer state differ after step ", done,
                            " (silent data corruption): ", detail::describe(report.mismatches));
    const bool stop = c.resilience.on_replica_mismatch == "stop";
    if (stop) agreed_end = true;  // every rank compares the same hashes
    HP_CHECK(!stop, what,
             ". Stopped before saving or committing anything of this step (resilience.on_replica_mismatch: stop)");
    if (lead) log::warn(what);
  };
  // optimizer->zero_grad(), with the gradients in a memory.offload tier zeroed one at a time and
  // settled (zeroing them all at once would bring them all into memory).
  const auto zero_grad = [&] {
    std::vector<std::pair<at::Tensor, at::Tensor>> offloaded;  // parameter, its gradient
    for (const at::Tensor& p : s.parts.parameters())
      if (p.grad().defined() && storage_tier_of(local_tensor(p.grad())))
        offloaded.emplace_back(p, std::exchange(p.mutable_grad(), at::Tensor()));
    optimizer->zero_grad();
#if !HP_LIBTORCH_2  // 1.13's zero_grad zeroes gradients in place (2.x's sets them to none)
    std::vector<at::Tensor> grads;
    for (auto& [p, grad] : offloaded) grads.push_back(local_tensor(grad));
    use_in_turn(grads, [](const at::Tensor& g) { g.zero_(); });
    for (auto& [p, grad] : offloaded) p.mutable_grad() = std::move(grad);
#endif
  };
  // One run (0, or 1 for a rerun) of the step's forward and backward: its gradients clipped, its
  // numbers into `record`. Returns this rank's loss and the stop request the ranks agree on.
  const auto run_step = [&](StepRecord& record, int64_t run) {
    zero_grad();
    auto [x, y] = data.train.train_batch(step, c.train.global_batch, first_row, rows);
    // Each cp rank's loss is the mean over its equal share of the tokens: the world mean below,
    // and FSDP's gradient average over dp x cp, are those of the mean over all tokens.
    double local_loss = 0.0;
    {
      nn::TokenCoordinates coordinates = s.coordinates(c, step, first_row);
      coordinates.run = run;
      const nn::TokenCoordinatesScope where(std::move(coordinates));
      // In bf16 the fp32 products left in forward and backward are small (the attention kernel's
      // probabilities' gradient, a MoE router): one BLAS thread, so that OpenBLAS's threads do not
      // wait on ATen's spinning workers (docs/performance.md#threads). The optimizer step (Muon's
      // fp32 products) keeps the usual count.
      std::optional<BlasThreadsGuard> one_blas_thread;
      if (c.train.dtype == "bf16") one_blas_thread.emplace(1);
      local_loss = train_step.forward_backward(step, s.shard_sequence(x), s.shard_sequence(y));
    }
    notify([&](Callback& cb) { cb.on_after_backward(step + 1); });
    double local_grad_norm = 0.0;
    record.grad_norm = clip_grad_norm_(counted, c.train.max_grad_norm > 0 ? c.train.max_grad_norm : 1e30, world, 2.0,
                                       copies, &local_grad_norm);
    record.loss = world_mean(local_loss, world);
    const int stop_signal = detail::gather_rank_numbers(
        local_loss, local_grad_norm, options.stop_request ? options.stop_request() : stop_requested(), world, record);
    return std::make_pair(local_loss, stop_signal);
  };
  // Ends a run before step `step + 1`'s optimizer step: the last checkpoint (of good parameters) is
  // committed, and the parameters and optimizer state, still those of step `step`, the last good
  // one, are saved as last words marked `why`. Returns the clause that says where (or "").
  const auto save_last_good_step = [&](const std::string& why) -> std::string {
    agreed_end = true;  // its callers throw next, on every rank
    checkpoints.finish();
    check_replicas_if_due(step, /*saving_last_words=*/true);  // no corrupt replica in the last words
    const std::optional<std::string> last_words =
        checkpoints.save_last_words(step, scheduler, why, detail::Checkpointing::LastWordsOf::kBeforeNextStep);
    if (!last_words) return "";
    notify([&](Callback& cb) { cb.on_save(step, *last_words); });
    return ", and step " + std::to_string(step) + " is saved as last words in " + *last_words;
  };
  std::optional<detail::StepRerun> reruns;
  if (c.resilience.rerun_on_anomaly) reruns.emplace(c.resilience.spike_factor, s.mesh, s.parts);
  const double tokens_per_step = static_cast<double>(c.train.global_batch * c.data.seq_len);
  const double flops_per_token = c.model->flops_per_token(c.data.seq_len);
  double timed_seconds = 0.0;
  // What in-memory checkpoints cost this rank: packing, the exchange of sizes, and the wait for the
  // copies (overlapped with the next step's forward and backward); and all steps' time.
  int64_t memory_checkpoints_kept = 0;
  double memory_checkpoint_seconds = 0.0, step_seconds = 0.0;
  int64_t packed_bytes = 0;
  int64_t timed_steps = 0;
  // What the parameters and optimizer state hold, and the slowest step, for last words after an error.
  detail::HeldState held{step, get_rng_state(s.mesh)};
  double slowest_step = 0.0;
  notify([&](Callback& cb) { cb.on_train_begin(step); });
  try {
    for (; step < c.train.steps; ++step) {
      checkpoints.note_step_start();
      held = {step, checkpoints.step_start_rng()};
      notify([&](Callback& cb) { cb.on_step_begin(step + 1); });
      const auto t0 = Clock::now();
      detail::StepProfile profile(lead && step + 1 == c.log.profile_step);
      detail::reset_step_peak(s.mesh.device(), memory);
      StepRecord record;
      record.step = step + 1;
      double local_loss = 0.0;
      int stop_signal = 0;
      std::tie(local_loss, stop_signal) = run_step(record, 0);
      if (reruns) {
        const std::optional<std::string> what = reruns->rerun_if_anomalous(record, checkpoints.step_start_rng(), [&] {
          int again = 0;
          std::tie(local_loss, again) = run_step(record, 1);
          if (stop_signal == 0) stop_signal = again;  // a request is honoured once it is agreed
        });
        if (what) {
          const bool transient = record.rerun == Rerun::kTransient;
          ++(transient ? result.transient_faults : result.persistent_anomalies);
          if (transient && c.resilience.on_transient_fault == "stop")
            HP_FAIL(*what, ". Stopped before the optimizer step (resilience.on_transient_fault: stop)",
                    save_last_good_step(hp::detail::str_cat("transient fault at step ", step + 1)));
          if (lead) log::warn(*what, transient ? "; going on with the rerun's numbers" : "");
        }
      }
      record.lr = scheduler.lr();
      if (!std::isfinite(record.loss) || !std::isfinite(record.grad_norm)) {
        const std::string where =
            detail::describe_nonfinite(s.parts, local_loss, world) +
            (record.rerun == Rerun::kPersistent ? " (not finite again when the step ran again: the data or the model)"
                                                : "");
        if (c.train.on_nonfinite == "stop")
          throw NonFiniteError(hp::detail::str_cat(
              "step ", step + 1, ": ", where,
              ". Stopped before the optimizer step (train.on_nonfinite: stop); the parameters are as they were",
              save_last_good_step(hp::detail::str_cat("not finite at step ", step + 1))));
        if (lead) log::warn("step ", step + 1, " skipped (train.on_nonfinite: skip): ", where);
        if (s.parts.forget_step) s.parts.forget_step();  // a skipped step changes nothing
        record.skipped = true;
        ++result.skipped_steps;
      }
      if (reruns) reruns->note(record);
      // A checkpoint staging in the background still reads what the hook and the optimizer change.
      checkpoints.wait_staged();
      if (in_memory) {  // the copies of the last in-memory checkpoint
        const auto waited = Clock::now();
        in_memory->finish_exchange();
        memory_checkpoint_seconds += seconds_since(waited);
      }
      held.step.reset();  // the hook and the optimizer change the state
      if (!record.skipped) {
        if (s.parts.before_optimizer_step) {
          models::StepStats stats = s.parts.before_optimizer_step();
          record.model_values = std::move(stats.values);
          record.model_summary = std::move(stats.summary);
        }
        notify([&](Callback& cb) { cb.on_before_optimizer_step(step + 1); });
        optimizer->step();
      }
      scheduler.step();
      held = {step + 1, get_rng_state(s.mesh)};
      check_replicas_if_due(step + 1, /*saving_last_words=*/stop_signal != 0);
      if (in_memory && (step + 1) % memory_interval == 0) {
        const auto kept = Clock::now();
        at::Tensor packed = checkpoints.pack(step + 1, scheduler);
        packed_bytes = packed.numel();
        in_memory->keep(step + 1, std::move(packed));
        memory_checkpoint_seconds += seconds_since(kept), ++memory_checkpoints_kept;
      }
      checkpoints.commit_earlier_than(step + 1);  // a save started last step has overlapped this one
      record.seconds = seconds_since(t0);
      slowest_step = std::max(slowest_step, record.seconds);
      step_seconds += record.seconds;
      profile.finish(c, step + 1, record.seconds);
      // The run's throughput leaves out the first step, the profiled one (timing every op slows it)
      // and a step that ran twice (a rerun on an anomaly).
      if (step > result.first_step && step + 1 != c.log.profile_step && !train_step.profiles(step, result.first_step) &&
          record.rerun == Rerun::kNone)
        timed_seconds += record.seconds, ++timed_steps;
      record.tokens_per_s = tokens_per_step / record.seconds;
      record.mfu = peak > 0 ? flops_per_token * record.tokens_per_s / peak : 0.0;
      record.peak_mem_bytes = static_cast<double>(detail::step_peak_bytes(s.mesh.device(), memory));
      result.losses.push_back(record.loss);
      result.grad_norms.push_back(record.grad_norm);
      // A stopping run saves first: the time before the launcher's SIGKILL is short.
      if (c.eval.interval > 0 && (step + 1) % c.eval.interval == 0 && step + 1 < c.train.steps && stop_signal == 0)
        record.eval_loss = evaluate();
      // Every rank agreed on the stop in the exchange above: last words, this step's state.
      const std::optional<std::string> dir =
          stop_signal != 0 ? checkpoints.save_last_words(step + 1, scheduler, detail::signal_name(stop_signal),
                                                         detail::Checkpointing::LastWordsOf::kAfterStep)
                           : checkpoints.save_if_due(step + 1, scheduler);
      if (dir) notify([&](Callback& cb) { cb.on_save(step + 1, *dir); });
      notify([&](Callback& cb) { cb.on_step_end(record); });
      if (record.eval_loss) notify([&](Callback& cb) { cb.on_eval(step + 1, *record.eval_loss); });
      if (stop_signal != 0) {
        result.stop_signal = stop_signal;
        detail::clear_stop_request();
        if (lead)
          log::warn("stopped after step ", step + 1, " of ", c.train.steps, " on ", detail::signal_name(stop_signal),
                    dir ? ": last words in " + *dir : std::string(" (no checkpoints: checkpoint.interval is 0)"));
        break;
      }
    }
    watchdog->progress("committing the last checkpoint");
    if (in_memory) in_memory->finish_exchange();
    checkpoints.finish();

    if (lead && replica_checks > 0 && timed_steps > 0)
      log::info("replica checks: ", replica_checks, ", ", 1e3 * replica_check_seconds / replica_checks, " ms each (",
                100.0 * (replica_check_seconds / replica_checks) / (timed_seconds / timed_steps),
                "% of a step, timed on rank 0)");
    if (lead && memory_checkpoints_kept > 0)
      log::info("in-memory checkpoints: ", memory_checkpoints_kept, ", ",
                1e3 * memory_checkpoint_seconds / memory_checkpoints_kept, " ms each, ",
                100.0 * memory_checkpoint_seconds / step_seconds,
                "% of the steps' time (timed on rank 0, whose state is ", static_cast<double>(packed_bytes) / 1e6,
                " MB)");
    const bool stopped = result.stop_signal != 0;  // no final evaluation or sample: the job is ending
    if (!stopped) result.eval_loss = evaluate();
    result.pipeline_profile = train_step.pipeline_profile();
    result.tokens_per_s = timed_steps ? tokens_per_step * static_cast<double>(timed_steps) / timed_seconds : 0.0;
    result.mfu = peak > 0 ? flops_per_token * result.tokens_per_s / peak : 0.0;
    if (c.sample.tokens > 0 && !stopped) {
      const data::ByteTokenizer tokenizer;
      const auto logits = [&](const at::Tensor& tokens) {
        watchdog->progress("sampling token " + std::to_string(tokens.numel() + 1));
        return s.sequence_logits(train_step, tokens);
      };
      result.sample = tokenizer.decode(
          detail::generate_greedy(logits, tokenizer.encode(c.sample.prompt), c.sample.tokens, c.model->max_seq()));
    }
  } catch (const std::exception& error) {
    notify([&](Callback& cb) { cb.on_exception(step + 1, error); });
    if (agreed_end) throw;  // the watchdog is stopped by now: every wait below has its own bound
    const std::string where = step < c.train.steps ? "in step " + std::to_string(step + 1) : "after the last step";
    std::string words;  // what became of the last words, as a clause
    detail::ErrorAccount account;
    try {
      // Under hprun --recover-processes a dead rank's process is started again at once: no rank of
      // this failure has an error to publish.
      std::function<bool()> rank_lost;
      if (in_memory && job::process_recovery())
        rank_lost = [next = job::recovery_count() + 1] { return job::recovery_begun(next); };
      account =
          error_accounting.account(error, where, held, c.checkpoint.interval > 0,
                                   std::chrono::milliseconds(static_cast<int64_t>(1e3 * slowest_step)), rank_lost);
      HP_CHECK(!account.step || account.step == held.step, "the ranks agreed on step ", account.step.value_or(0),
               ", but this rank holds ",
               held.step ? "step " + std::to_string(*held.step) : std::string("no whole step"));
      if (account.step) {
        const std::optional<std::string> dir = checkpoints.save_after_error(
            *account.step, held.rng, scheduler, "an error in " + account.origin.substr(0, account.origin.find(':')));
        if (dir)
          words = hp::detail::str_cat("Step ", *account.step, ", which every rank held, is saved in ", *dir, ".");
      } else if (!account.why_not.empty()) {
        words = "No last words: " + account.why_not + ".";
      }
    } catch (const std::exception& e) {
      words = std::string("No last words: ") + e.what();
    }
    if (account.origin.empty()) {   // a rank died or hangs: the failed collective names it
      if (in_memory) {              // and this rank's memory can recover
        comm::leave_groups(world);  // its peers still waiting for it need not wait for their timeout
        throw RankLostError(error.what());
      }
      throw;
    }
    if (account.own_error && words.empty()) throw;
    const std::string own = error.what();
    const std::string then = own.empty() || own.back() == '.' ? " " + words : ". " + words;
    if (account.own_error) HP_FAIL(own, then);
    throw OtherRankError(hp::detail::str_cat("training ended because of an error on another rank (", account.origin,
                                             "); on this rank (world rank ", world.rank(), "): ", own, then));
  }
  if (result.stop_signal == 0) notify([&](Callback& cb) { cb.on_eval(c.train.steps, result.eval_loss); });
  notify([&](Callback& cb) { cb.on_train_end(result); });
  return result;
}

}  // namespace hp::train
