#include "hp/train/dry_run.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "hp/comm/comm_debug_mode.h"
#include "hp/comm/fused_matmul.h"
#include "hp/comm/init.h"
#include "hp/core/error.h"
#include "hp/core/log.h"
#include "hp/core/memory_timeline.h"
#include "hp/core/memory_tracker.h"
#include "hp/data/text_data.h"
#include "hp/dtensor/local.h"
#include "hp/models/model_spec.h"
#include "hp/nn/module.h"
#include "hp/nn/moe.h"
#include "hp/nn/token_coordinates.h"
#include "hp/optim/clip_grad.h"
#include "hp/optim/optimizer_kind.h"
#include "hp/parallel/parallel_dims.h"
#include "hp/train/train_step.h"
#include "hp/train/trainer.h"
#include "train/dry_run_mode.h"
#include "train/peak_breakdown.h"
#include "train/setup.h"
#include "train/work_recorder.h"

namespace hp::train {
namespace {

int64_t bytes_of(const at::Tensor& t) {
  const at::Tensor& local = local_tensor(t);
  return local.numel() * static_cast<int64_t>(local.element_size());
}

// The token files the trainer's data loader reads into memory (uint8 tokens), when the corpus is
// prepared here (a run or hp-train's first rank did); -1 when it is not.
int64_t data_bytes(const TrainConfig& c) {
  try {
    const auto corpus = data::prepared_corpus(c.data.sources, c.data.cache_dir, c.data.eval_fraction);
    return corpus ? corpus->train_tokens + corpus->eval_tokens : -1;
  } catch (const std::exception&) {  // a corpus.json that is not prepare_corpus's
    return -1;
  }
}

std::string mib(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2) << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return out.str();
}

// Every router of `model` routes by `routing` (its own FQN's counts).
void give_routers(nn::Module& model, const std::shared_ptr<const RoutingModel>& routing) {
  for (const auto& [fqn, router] : nn::routers_of(model)) {
    const int64_t top_k = router->options().top_k, experts = router->options().experts;
    router->set_modelled_counts([routing, name = fqn, top_k, experts](int64_t tokens) {
      return routing->counts(name, tokens, top_k, experts);
    });
  }
}

// What the timeline's allocations that live now are (parameters, their gradients, the optimizer's
// state), and the model's modules by name.
detail::TimelineNames timeline_names(const MemoryTimeline& timeline, const models::ModelParts& parts,
                                     torch::optim::Optimizer& optimizer) {
  detail::TimelineNames names;
  const auto name = [&](const at::Tensor& t, const char* category) {
    if (!t.defined()) return;
    const at::Tensor& local = local_tensor(t);
    if (!local.has_storage()) return;
    const int64_t id = timeline.live_allocation(local.storage().data_ptr().get_context());
    if (id >= 0) names.held.emplace(id, category);
  };
  for (const at::Tensor& p : parts.parameters()) {
    name(p, detail::kParameters);
    name(p.grad(), detail::kGradients);
  }
  visit_state(optimizer, [&](const at::Tensor&, ParamStateFields& fields) {
    for (const auto& [field, state] : fields.tensors) name(state, detail::kOptimizerState);
  });
  for (auto& [fqn, module] : parts.model->named_modules_fqn()) names.modules.emplace(module, fqn);
  return names;
}

// The dry run after the checks: everything that may meet an op that needs values. `exchange`
// carries messages with values between the fake worlds of a pipeline's ranks. A mixture of experts'
// routers choose by `routing`; the recipe's balancing hook, which the trainer runs before the
// optimizer, is left out with the counts it would sum: a few numbers per layer.
DryRunReport run_dry(const TrainConfig& c, int world_size, int rank, const std::shared_ptr<const RoutingModel>& routing,
                     bool lifetimes, const std::shared_ptr<comm::FakeExchange>& exchange = nullptr) {
  DryRunReport report;
  report.rank = rank;
  report.world_size = world_size;
  report.data_bytes = data_bytes(c);
  const comm::ProcessGroup world = comm::fake_world(world_size, rank, world_options(c), exchange);
  detail::Setup s = detail::build(c, world);
  give_routers(*s.parts.model, routing);
  // Counted from here, as the trainer counts from before it gives the parameters their memory: meta
  // tensors, and the host's (positions, masks, metadata) as in a real run.
  MemoryTracker memory(MemoryTracker::kCpuAndMeta);
  const auto timeline = std::make_shared<MemoryTimeline>();
  memory.record(timeline);
  int64_t step_begins = 0, step_ends = 0;  // the reported step's events
  const nn::MetaParametersAllowed meta_parameters;
  detail::DryRunMode mode;
  const DispatchModeGuard on(mode);
  s.parts.init_parameters(c.seed, at::kMeta);
  const std::unique_ptr<torch::optim::Optimizer> optimizer = detail::make_optimizer(c, s.parts, s.parts.parameters());
  TrainStepOptions step_options;
  step_options.micro_batches = c.micro_batches();
  step_options.deterministic = c.train.deterministic;
  step_options.world = world;
  TrainStep train_step(s.parts, step_options);
  const std::vector<at::Tensor> counted = s.parts.counted_parameters(), copies = s.parts.copied_parameters();
  const int64_t rows = c.per_rank_batch(), first_row = s.dp_rank * rows;

  // Two steps as the trainer runs them; the second, with the optimizer's state, is the one reported.
  for (int64_t step = 0; step < 2; ++step) {
    step_begins = timeline->events();
    comm::CommDebugMode comm;
    // The reported step's work, for the cost model (its ops on meta tensors, hp's kernels, its
    // collectives).
    report.work = StepWork{};
    detail::WorkRecorder recorder(&report.work, /*timed=*/false);
    const DispatchModeGuard recording(recorder);
    const KernelObserverGuard kernels(&recorder);
    memory.reset_peak();
    optimizer->zero_grad();
    const auto tokens = at::TensorOptions().dtype(at::kLong).device(at::kMeta);
    const at::Tensor x = at::empty({rows, c.data.seq_len}, tokens), y = at::empty({rows, c.data.seq_len}, tokens);
    {
      const nn::TokenCoordinatesScope where(s.coordinates(c, step, first_row));
      train_step.forward_backward(step, s.shard_sequence(x), s.shard_sequence(y));
    }
    report.forward_backward_peak_bytes = memory.peak();
    memory.reset_peak();
    const int64_t before_optimizer = memory.current();
    recorder.set_optimizer_phase(true);
    clip_grad_norm_(counted, c.train.max_grad_norm > 0 ? c.train.max_grad_norm : 1e30, world, 2.0, copies);
    optimizer->step();
    if (step == 0) report.optimizer_state_bytes = memory.current() - before_optimizer;
    report.optimizer_peak_bytes = memory.peak();
    report.peak_bytes = std::max(report.forward_backward_peak_bytes, report.optimizer_peak_bytes);
    report.collectives.clear();
    report.collective_bytes.clear();
    for (const char* op :
         {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv", "barrier"}) {
      if (comm.count(op) == 0) continue;
      report.collectives[op] = comm.count(op);
      report.collective_bytes[op] = comm.bytes(op);
    }
    step_ends = timeline->events();
  }
  for (const at::Tensor& p : s.parts.parameters()) {
    report.parameter_bytes += bytes_of(p);
    if (p.grad().defined()) report.gradient_bytes += bytes_of(p.grad());
  }
  report.fused_workspace_bytes = comm::fused_workspace_bytes(s.mesh.get_group("tp"));
  report.host_ops = mode.host_ops();
  report.host_compute = mode.host_compute();
  const detail::TimelineNames names = timeline_names(*timeline, s.parts, *optimizer);
  const std::vector<MemoryTimeline::Allocation> allocations = timeline->allocations();
  const detail::PeakBreakdown peak =
      detail::break_down_peak(allocations, timeline->events(), step_begins, step_ends, names, 10);
  report.peak_by_category = peak.by_category;
  report.top_at_peak = peak.top;
  if (lifetimes) report.lifetimes_csv = detail::lifetimes_csv(allocations, step_begins, step_ends, names);
  return report;
}

// A pipeline stage learns the shape of its input from the stage before it, and stages sit on
// positions in both orders (ZBV's second stage of position 0 follows the first of position 1): the
// dry run of a pipeline rank plays all ranks of its pipeline (one per position, with its
// coordinates on every other dim) together, on threads that exchange those messages.
std::vector<DryRunReport> run_pipeline_dry(const TrainConfig& c, int world_size, int rank,
                                           const std::shared_ptr<const RoutingModel>& routing, bool lifetimes) {
  const std::vector<int> peers =
      build_mesh(comm::fake_world(world_size, rank, world_options(c)), c.parallel, c.train.device)
          .get_group("pp")
          .ranks();
  const auto exchange = std::make_shared<comm::FakeExchange>();
  std::vector<DryRunReport> reports(peers.size());
  std::mutex mu;
  std::string first_failure;  // the cause; the others' failures follow from the abort
  const auto play = [&](size_t i) {
    try {
      reports[i] = run_dry(c, world_size, peers[i], routing, lifetimes, exchange);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      {
        const std::lock_guard<std::mutex> lock(mu);
        if (first_failure.empty())
          first_failure = "world rank " + std::to_string(peers[i]) + (peers[i] == rank ? "" : " (a pipeline peer)") +
                          ": " + what.substr(0, what.find('\n'));
      }
      exchange->abort("the dry run of world rank " + std::to_string(peers[i]) + " failed");
    }
  };
  {
    // The peers on threads of their own (joined however this scope ends), this rank on this
    // thread, where the caller's thread-local settings apply.
    struct Joined {
      std::vector<std::thread> threads;
      ~Joined() {
        for (std::thread& t : threads) t.join();
      }
    } peer_threads;
    for (size_t i = 0; i < peers.size(); ++i)
      if (peers[i] != rank)
        peer_threads.threads.emplace_back([&, i] {
          const log::LogRankGuard log_rank(peers[i]);
          play(i);
        });
    for (size_t i = 0; i < peers.size(); ++i)
      if (peers[i] == rank) play(i);
  }
  HP_CHECK(first_failure.empty(), first_failure);
  return reports;
}

constexpr const char* kCovers =
    ". The dry run covers models whose forward and backward need no values but a mixture of experts' routing counts";

}  // namespace

std::vector<DryRunReport> dry_run_pipeline(const TrainConfig& c, int world_size, int rank,
                                           const DryRunOptions& options) {
  const auto routing = std::make_shared<const RoutingModel>(options.routing);
  validate(c, world_size);
  HP_CHECK(c.memory.budget_mb == 0, "dry run: memory.budget_mb chooses memory.blocks when a run starts, from a ",
           "profiled step; dry-run the memory.blocks it logs, or run hp-train --dry-run, which plans first");
  HP_CHECK(c.train.device == "cpu", "dry run: train.device ", c.train.device,
           " is not covered yet: it predicts the host memory of train.device cpu");
  try {
    if (c.parallel.pp > 1) return run_pipeline_dry(c, world_size, rank, routing, options.lifetimes);
    return {run_dry(c, world_size, rank, routing, options.lifetimes)};
  } catch (const c10::Error& e) {
    // An op that reads values or has no meta kernel here.
    const std::string what = e.what_without_backtrace();
    HP_FAIL("dry run of ", c.model->describe(), " on ", c.parallel.str(),
            ": an op failed on the meta device: ", what.substr(0, what.find('\n')), kCovers);
  } catch (const std::exception& e) {  // such a failure inside a pipeline stage, or another one
    const std::string what = e.what();
    HP_FAIL("dry run of ", c.model->describe(), " on ", c.parallel.str(), " failed: ", what.substr(0, what.find('\n')),
            kCovers);
  }
}

DryRunReport dry_run(const TrainConfig& c, int world_size, int rank, const DryRunOptions& options) {
  for (DryRunReport& report : dry_run_pipeline(c, world_size, rank, options))
    if (report.rank == rank) return std::move(report);
  HP_FAIL("dry run: rank ", rank, " is not in its own pipeline");  // unreachable
}

std::string DryRunReport::table() const {
  std::ostringstream out;
  out << "rank " << rank << " of " << world_size << ":\n"
      << "  parameters        " << mib(parameter_bytes) << "\n"
      << "  gradients         " << mib(gradient_bytes) << "\n"
      << "  optimizer state   " << mib(optimizer_state_bytes) << "\n"
      << "  data              "
      << (data_bytes >= 0 ? mib(data_bytes) + " (loaded before the trainer counts; not in the peak)"
                          : std::string("unknown (the corpus is not prepared here)"))
      << "\n"
      << "  peak              " << mib(peak_bytes) << " (forward+backward " << mib(forward_backward_peak_bytes)
      << ", clipping+optimizer " << mib(optimizer_peak_bytes) << ")\n";
  if (fused_workspace_bytes > 0)
    out << "  fused workspace   " << mib(fused_workspace_bytes)
        << " (async TP's, mapped apart from the peak; between processes in /dev/shm, one per tp rank)\n";
  out << "  collectives/step ";
  for (const auto& [op, n] : collectives) out << " " << op << " x" << n << " (" << mib(collective_bytes.at(op)) << ")";
  out << "\n  at the peak      ";
  for (const auto& [category, bytes] : peak_by_category) out << " " << category << " " << mib(bytes) << ";";
  out << "\n  largest at the peak:\n";
  for (const auto& [what, bytes] : top_at_peak)
    out << "    " << std::left << std::setw(36) << what << mib(bytes) << "\n";
  return out.str();
}

std::string DryRunReport::json() const {
  return nlohmann::json{{"rank", rank},
                        {"world_size", world_size},
                        {"parameter_bytes", parameter_bytes},
                        {"gradient_bytes", gradient_bytes},
                        {"optimizer_state_bytes", optimizer_state_bytes},
                        {"data_bytes", data_bytes},
                        {"peak_bytes", peak_bytes},
                        {"forward_backward_peak_bytes", forward_backward_peak_bytes},
                        {"optimizer_peak_bytes", optimizer_peak_bytes},
                        {"fused_workspace_bytes", fused_workspace_bytes},
                        {"host_ops", host_ops},
                        {"host_compute", host_compute},
                        {"collectives", collectives},
                        {"collective_bytes", collective_bytes},
                        {"peak_by_category", peak_by_category},
                        {"top_at_peak", top_at_peak}}
      .dump();
}

bool DryRunReport::fits(int64_t limit_bytes, double allocator_slack) const {
  HP_CHECK(allocator_slack >= 0.0, "DryRunReport::fits: allocator_slack must be >= 0, got ", allocator_slack);
  return static_cast<double>(peak_bytes) * (1.0 + allocator_slack) <= static_cast<double>(limit_bytes);
}

}  // namespace hp::train
