// hp-train: train a model from a YAML config, on as many ranks as hprun starts.
//
//   hprun --nproc-per-node 4 hp-train --config examples/tiny_llama.yaml [--set train.steps=50] [--resume auto]
#include <hp/comm/init.h>
#include <hp/core/error.h>
#include <hp/core/job.h>
#include <hp/train/cost_model.h>
#include <hp/train/memory_checkpoints.h>
#include <hp/train/routing_model.h>
#include <hp/train/stop.h>
#include <hp/train/trainer.h>

#include <unistd.h>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/flags.h"
#include "common/plan_flags.h"

namespace {

// docs/training.md#exit-codes
// 3 is the watchdog's (src/train/watchdog.cpp), 4 hp::job::kExitOtherRankFailed.
constexpr int kFailed = 1, kConfigError = 2;

// What the command line says.
struct Args {
  std::string config_path;
  std::vector<std::string> overrides;
  hp::train::TrainOptions options;
  bool routing_given = false;  // --routing answers a --dry-run, even when it names the default
};

const std::vector<hp::tools::Flag<Args>>& flags() {
  static const std::vector<hp::tools::Flag<Args>> table = {
      {{"--config"},
       "FILE",
       "the run's YAML config (docs/training.md lists every key)",
       [](Args& a, const std::string& v) { a.config_path = v; }},
      {{"--set"},
       "KEY=VALUE",
       "override one key, e.g. --set train.steps=20 --set parallel.tp=2",
       [](Args& a, const std::string& v) { a.overrides.push_back(v); }},
      {{"--resume"},
       "auto|never",
       "auto: continue from the run's latest checkpoint if there is one (default: never; auto when hprun "
       "restarts the job)",
       [](Args& a, const std::string& v) {
         if (v != "auto" && v != "never") throw hp::tools::UsageError("--resume takes auto or never, got '" + v + "'");
         a.options.resume = v == "auto";
       }},
      {{"--dry-run"},
       "",
       "print the plan (mesh, each rank's parameters, estimated memory) and exit (with memory.budget_mb, after the "
       "profiled steps that choose memory.blocks)",
       [](Args& a, const std::string&) { a.options.dry_run = true; }},
      {{"--memory-limit"},
       "GIB",
       "with --dry-run: say whether each rank's memory, plus the allocator slack, fits in GIB GiB",
       [](Args& a, const std::string& v) { a.options.memory_limit_gib = hp::tools::memory_limit_gib(v); }},
      {{"--allocator-slack"},
       "FRACTION",
       "with --memory-limit: what the allocator holds beyond the tensors, as a fraction of their peak (default 0.1)",
       [](Args& a, const std::string& v) { a.options.allocator_slack = hp::tools::allocator_slack(v); }},
      {{"--routing"},
       "SPEC",
       "with --dry-run: what a mixture of experts' routers choose: balanced (default), skewed:S (expert 0 of every "
       "layer takes the share S of the rows, at most one row per token), or histogram:FILE (JSON: router FQN -> "
       "relative loads)",
       [](Args& a, const std::string& v) {
         a.options.routing = hp::tools::routing_spec(v);
         a.routing_given = true;
       }},
      {{"--report-dir"},
       "DIR",
       "with --dry-run: each rank also writes its report to DIR: rank_N.txt, rank_N.json (the peak by category and "
       "its largest contributors included) and rank_N_lifetimes.csv (every allocation of the step)",
       [](Args& a, const std::string& v) {
         if (v.empty()) throw hp::tools::UsageError("--report-dir needs a directory");
         a.options.report_dir = v;
       }},
      {{"--calibration"},
       "FILE",
       "with --dry-run: also predict the step time from this calibration (hp-plan --calibrate writes one)",
       [](Args& a, const std::string& v) {
         try {
           hp::train::Calibration::read(v);  // a mistake is the command line's, found before any rank waits
         } catch (const hp::Error& e) {
           throw hp::tools::UsageError(std::string("--calibration: ") + e.what());
         }
         a.options.calibration = v;
       }},
      {{"--no-progress"},
       "",
       "no progress lines (metrics still go to RUN_DIR/metrics.jsonl)",
       [](Args& a, const std::string&) { a.options.progress = false; }},
  };
  return table;
}

void usage(std::ostream& out) {
  out << "usage: hp-train --config FILE [--set KEY=VALUE]... [--resume auto|never] [--dry-run [--routing SPEC] "
         "[--report-dir DIR] [--calibration FILE] [--memory-limit GIB [--allocator-slack FRACTION]]] "
         "[--no-progress]\n\n"
      << hp::tools::flag_help(flags())
      << "\nStart several ranks with hprun: hprun --nproc-per-node 4 hp-train --config examples/tiny_llama.yaml\n";
}

// Draws the loss curve with hp-plot, which is installed next to this program.
void plot(const std::string& run_dir) {
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  const auto plotter = self.parent_path() / "hp-plot";
  if (!std::filesystem::exists(plotter)) return;
  const std::string command = "'" + plotter.string() + "' '" + run_dir + "' > /dev/null";
  if (std::system(command.c_str()) != 0) std::cerr << "hp-train: warning: hp-plot failed for " << run_dir << "\n";
}

// Rank 0's last words to the user: the result and where the run's files are.
void print_summary(const hp::train::TrainConfig& config, const hp::train::TrainResult& result) {
  plot(config.run_dir);
  std::cout << std::fixed << std::setprecision(3) << "\nfinal eval loss " << result.eval_loss
            << " nats/byte (unigram entropy of the corpus " << result.unigram_entropy << ")\n"
            << std::setprecision(0) << "throughput " << result.tokens_per_s << " tokens/s, MFU " << std::setprecision(1)
            << 100.0 * result.mfu << "%\n"
            << "run directory " << config.run_dir << ": metrics.jsonl, loss.svg"
            << (config.checkpoint.interval > 0 && config.checkpoint.dir.empty() ? ", checkpoints/" : "") << "\n";
  if (config.checkpoint.interval > 0 && !config.checkpoint.dir.empty())
    std::cout << "checkpoints in " << config.checkpoint.dir << "\n";
  if (!result.sample.empty()) std::cout << "\nsample:\n" << result.sample << "\n";
}

// hprun --cpu-layout auto times the job under each layout it considers by a short run of it
// (hp/core/job.h, kLayoutProbeEnv): the config's first steps (the first one untimed), stopped as a
// stop request stops a run (without its final evaluation), in a run directory inside the job
// directory, with no checkpoints, evaluation, sample, profile, injected faults or matmul peak
// measurement. A run with no step to time (a dry run, one step) answers that it has nothing to
// time.
constexpr int64_t kProbeSteps = 8;

std::optional<std::string> layout_probe_file() {
  const char* file = std::getenv(hp::job::kLayoutProbeEnv);
  if (file == nullptr || *file == '\0') return std::nullopt;
  return std::string(file);
}

// Rank 0's answer to hprun: the throughput, or kLayoutProbeSkip.
void answer_layout_probe(const std::string& file, const std::string& answer) {
  if (!hp::job::write_atomically(file, answer + "\n"))
    throw std::runtime_error("could not write the layout probe's answer to " + file);
}

void prepare_layout_probe(hp::train::TrainConfig& config, hp::train::TrainOptions& options) {
  const std::optional<std::string> job_dir = hp::job::dir();
  if (!job_dir) throw std::runtime_error(std::string(hp::job::kLayoutProbeEnv) + " is set outside an hprun job");
  config.run_dir = *job_dir + "/layout-probe-run";
  config.checkpoint.interval = 0;
  config.eval.interval = 0;
  config.sample.tokens = 0;
  config.log.profile_step = 0;
  config.pp_timeline_step = 0;
  config.resilience.faults.clear();
  options.resume = false;
  options.progress = false;
  options.measure_peak = false;
  // Stopped after its last step too when the config has fewer: no final evaluation either way.
  options.stop_request = [steps = int64_t{0}, last = std::min(kProbeSteps, config.train.steps)]() mutable {
    if (const int signal = hp::train::stop_requested()) return signal;  // hprun's own, forwarded
    return ++steps >= last ? SIGTERM : 0;
  };
}

// hprun --recover-processes (docs/resilience.md#process-level-recovery): how long a rank whose
// training lost a peer waits for hprun to start the peer's process again. hprun does so as soon as
// it sees the process exit, or ends the whole job instead.
constexpr auto kRecoveryWait = std::chrono::seconds(60);

// Whether hprun started the lost rank's process again as recovery `recovery` of this attempt.
bool await_recovery(int recovery) {
  for (const auto until = std::chrono::steady_clock::now() + kRecoveryWait; std::chrono::steady_clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(20)))
    if (hp::job::recovery_begun(recovery)) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  std::vector<std::string> positionals;
  try {
    if (!hp::tools::parse_flags(argc, argv, flags(), args, positionals)) {
      usage(std::cout);
      return 0;
    }
    if (!positionals.empty()) throw hp::tools::UsageError("unexpected argument '" + positionals.front() + "'");
    if (args.config_path.empty()) throw hp::tools::UsageError("--config FILE is required");
    if (args.options.memory_limit_gib > 0.0 && !args.options.dry_run)
      throw hp::tools::UsageError("--memory-limit answers a --dry-run; add --dry-run");
    if (args.routing_given && !args.options.dry_run) throw hp::tools::UsageError("--routing goes with --dry-run");
    if (!args.options.report_dir.empty() && !args.options.dry_run)
      throw hp::tools::UsageError("--report-dir goes with --dry-run");
    if (!args.options.calibration.empty() && !args.options.dry_run)
      throw hp::tools::UsageError("--calibration goes with --dry-run");
    if (args.options.allocator_slack != hp::train::TrainOptions{}.allocator_slack &&
        args.options.memory_limit_gib == 0.0)
      throw hp::tools::UsageError("--allocator-slack goes with --memory-limit");
  } catch (const hp::tools::UsageError& e) {
    std::cerr << "hp-train: " << e.what() << "\n\n";
    usage(std::cerr);
    return kConfigError;
  }
  hp::train::TrainOptions& options = args.options;
  const std::optional<std::string> probe = layout_probe_file();
  // A mistake a restart would repeat (the config, its fit to the world) exits 2; a failure 1.
  hp::train::TrainConfig config;
  try {
    // The config is read and checked before the rendezvous, so a mistake costs no waiting.
    config = hp::train::load_config(args.config_path, args.overrides);
    if (probe && options.dry_run) {  // nothing to time: every rank ends at once, rank 0 says so
      const char* rank = std::getenv("RANK");
      if (rank == nullptr || std::string(rank) == "0") answer_layout_probe(*probe, hp::job::kLayoutProbeSkip);
      return 0;
    }
    if (probe) prepare_layout_probe(config, options);
  } catch (const std::exception& e) {
    std::cerr << "hp-train: error: " << e.what() << "\n";
    return kConfigError;
  }
  // hprun --recover-processes starts a dead rank's process again and leaves the others running:
  // they keep their state in memory for it (docs/resilience.md#process-level-recovery).
  const bool recover_processes = hp::job::process_recovery();
  if (recover_processes && config.resilience.in_memory_checkpoint_interval == 0 && !options.dry_run) {
    std::cerr << "hp-train: error: hprun --recover-processes starts a dead rank's process again alone, which then "
                 "takes its state from a buddy's memory: set resilience.in_memory_checkpoint_interval (e.g. --set "
                 "resilience.in_memory_checkpoint_interval=10)\n";
    return kConfigError;
  }
  options.memory_checkpoints = std::make_shared<hp::train::MemoryCheckpoints>();
  int recovery = hp::job::recovery_count();  // a process started again joins this recovery
  options.recover_from_memory = recovery > 0;
  try {
    hp::comm::InitOptions init;
    init.group = hp::train::world_options(config);
    // A preemption notice or Ctrl-C: every rank saves the step it is in, then exits 128 + signal.
    hp::train::stop_on_signals();
    hp::train::TrainResult result;
    int rank = 0;
    for (;;) {
      if (recovery > 0) {  // the ranks meet again in the recovery's own store
        init.env = hp::comm::read_launch_env();
        init.env->rendezvous_file =
            hp::job::dir().value_or(".") + "/" + hp::job::recovery_rendezvous_file(hp::job::restart_count(), recovery);
      }
      hp::comm::ProcessGroup world = hp::comm::init_process_group(init);
      rank = world.rank();
      try {
        hp::train::validate(config, world.size());
      } catch (const hp::Error& e) {
        std::cerr << "hp-train: error: " << e.what() << "\n";
        return kConfigError;
      }
      if (const int restarts = hp::job::restart_count(); restarts > 0 && !options.resume && recovery == 0) {
        // hprun restarted the job after a failure: carry on from the newest checkpoint this job
        // committed (one an earlier run left in the run directory is not this job's to continue).
        options.resume = options.resume_only_this_job = true;
        if (rank == 0)
          std::cout << "hp-train: restart " << restarts << " of this job: resuming from its latest checkpoint\n";
      }
      try {
        result = hp::train::train(config, world, options);
        break;
      } catch (const hp::train::RankLostError& e) {
        if (!recover_processes) throw;
        std::cerr << "hp-train: " << e.what() << "\nhp-train: waiting for hprun to start the lost rank's process "
                  << "again\n";
        if (!await_recovery(recovery + 1)) throw;
        ++recovery;
        setenv(hp::job::kRecoveryEnv, std::to_string(recovery).c_str(), 1);  // for the run's report to hprun
        options.recover_from_memory = true;
        std::cerr << "hp-train: recovery " << recovery << ": world rank " << rank << " goes on in its process (pid "
                  << getpid() << ")\n";
      }
    }
    if (probe) {  // no step was timed (too few steps): nothing to choose by
      if (rank == 0)
        answer_layout_probe(*probe, result.tokens_per_s > 0 ? std::to_string(result.tokens_per_s)
                                                            : std::string(hp::job::kLayoutProbeSkip));
      return 0;
    }
    if (result.stop_signal != 0) {
      if (rank == 0)
        std::cout << "hp-train: stopped early after step " << result.first_step + result.losses.size()
                  << "; --resume auto continues from its last words\n";
      return 128 + result.stop_signal;
    }
    if (rank == 0 && !options.dry_run) print_summary(config, result);
    return 0;
  } catch (const hp::train::OtherRankError& e) {
    std::cerr << "hp-train: failed: " << e.what() << "\n";
    return hp::job::kExitOtherRankFailed;
  } catch (const std::exception& e) {
    // A step not finite, a peer that died or hung, a fault: a restart may get past it.
    std::cerr << "hp-train: failed: " << e.what() << "\n";
    return kFailed;
  }
}
