// hp-train: train a model from a YAML config, on as many ranks as hprun starts.
//
//   hprun --nproc-per-node 4 hp-train --config examples/tiny_llama.yaml [--set train.steps=50] [--resume auto]
#include <hp/comm/init.h>
#include <hp/core/error.h>
#include <hp/core/job.h>
#include <hp/train/trainer.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "common/flags.h"

namespace {

// What the command line says.
struct Args {
  std::string config_path;
  std::vector<std::string> overrides;
  hp::train::TrainOptions options;
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
       "print the plan (mesh, each rank's parameters, estimated memory) and exit",
       [](Args& a, const std::string&) { a.options.dry_run = true; }},
      {{"--no-progress"},
       "",
       "no progress lines (metrics still go to RUN_DIR/metrics.jsonl)",
       [](Args& a, const std::string&) { a.options.progress = false; }},
  };
  return table;
}

void usage(std::ostream& out) {
  out << "usage: hp-train --config FILE [--set KEY=VALUE]... [--resume auto|never] [--dry-run] [--no-progress]\n\n"
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
  } catch (const hp::tools::UsageError& e) {
    std::cerr << "hp-train: " << e.what() << "\n\n";
    usage(std::cerr);
    return 2;
  }
  const std::string& config_path = args.config_path;
  const std::vector<std::string>& overrides = args.overrides;
  hp::train::TrainOptions& options = args.options;
  try {
    // The config is read and checked before the rendezvous, so a mistake costs no waiting.
    const hp::train::TrainConfig config = hp::train::load_config(config_path, overrides);
    hp::comm::InitOptions init;
    init.group = hp::train::world_options(config);
    hp::comm::ProcessGroup world = hp::comm::init_process_group(init);
    if (const int restarts = hp::job::restart_count(); restarts > 0 && !options.resume) {
      // hprun restarted the job after a failure: carry on from the newest committed checkpoint.
      options.resume = true;
      if (world.rank() == 0)
        std::cout << "hp-train: restart " << restarts << " of this job: resuming from the latest checkpoint\n";
    }
    const hp::train::TrainResult result = hp::train::train(config, world, options);
    if (world.rank() == 0 && !options.dry_run) {
      plot(config.run_dir);
      std::cout << std::fixed << std::setprecision(3) << "\nfinal eval loss " << result.eval_loss
                << " nats/byte (unigram entropy of the corpus " << result.unigram_entropy << ")\n"
                << std::setprecision(0) << "throughput " << result.tokens_per_s << " tokens/s, MFU "
                << std::setprecision(1) << 100.0 * result.mfu << "%\n"
                << "run directory " << config.run_dir << ": metrics.jsonl, loss.svg"
                << (config.checkpoint.interval > 0 && config.checkpoint.dir.empty() ? ", checkpoints/" : "") << "\n";
      if (config.checkpoint.interval > 0 && !config.checkpoint.dir.empty())
        std::cout << "checkpoints in " << config.checkpoint.dir << "\n";
      if (!result.sample.empty()) std::cout << "\nsample:\n" << result.sample << "\n";
    }
    return 0;
  } catch (const hp::Error& e) {
    // A run that failed (a step not finite, a peer that hung) exits 1; a mistake in the config 2.
    const bool failed = dynamic_cast<const hp::train::NonFiniteError*>(&e) != nullptr ||
                        dynamic_cast<const hp::TimeoutError*>(&e) != nullptr;
    std::cerr << "hp-train: " << (failed ? "failed: " : "error: ") << e.what() << "\n";
    return failed ? 1 : 2;
  } catch (const std::exception& e) {
    std::cerr << "hp-train: failed: " << e.what() << "\n";
    return 1;
  }
}
