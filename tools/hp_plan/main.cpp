// hp-plan: which layout of a training job fits each rank's memory, and which is fastest.
//
//   hprun --nproc-per-node 4 hp-plan --config examples/tiny_llama.yaml --calibrate calibration.json
//   hp-plan --config examples/tiny_llama.yaml --world 4 --calibration calibration.json --out plan.yaml
//   hprun --nproc-per-node 4 hp-train --config plan.yaml
//
// The first command measures this machine (docs/planning.md#the-cost-model) on the ranks hprun
// starts; the second dry-runs every candidate layout on one process, ranks them by predicted step
// time and writes the fastest that fits as an hp-train config.
#include <hp/comm/init.h>
#include <hp/core/error.h>
#include <hp/models/model_spec.h>
#include <hp/pp/schedule.h>
#include <hp/train/auto_parallel.h>
#include <hp/train/cost_model.h>
#include <hp/train/routing_model.h>
#include <hp/train/trainer.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/flags.h"
#include "common/plan_flags.h"

namespace {

constexpr int kFailed = 1, kUsageError = 2;

struct Args {
  std::string config_path, calibrate_to, calibration_path, out = "plan.yaml", json_path;
  std::vector<std::string> overrides;
  int world = 0, top = 10;
  double memory_limit_gib = 0.0, allocator_slack = 0.1;
  std::string routing = "balanced";
  std::vector<std::string> schedules = hp::train::PlanOptions{}.schedules;
  bool quiet = false;
};

int positive_int(const std::string& flag, const std::string& v) {
  const double d = hp::tools::parse_double(flag, v);
  if (!(d >= 1) || d != std::floor(d) || d > 1 << 20)
    throw hp::tools::UsageError(flag + " expects a positive whole number, got '" + v + "'");
  return static_cast<int>(d);
}

std::string default_schedules() {
  std::string names;
  for (const std::string& name : hp::train::PlanOptions{}.schedules) names += (names.empty() ? "" : ",") + name;
  return names;
}

const std::vector<hp::tools::Flag<Args>>& flags() {
  static const std::vector<hp::tools::Flag<Args>> table = {
      {{"--config"},
       "FILE",
       "the job's YAML config (as hp-train takes it)",
       [](Args& a, const std::string& v) { a.config_path = v; }},
      {{"--set"},
       "KEY=VALUE",
       "override one key of the config, as hp-train's --set",
       [](Args& a, const std::string& v) { a.overrides.push_back(v); }},
      {{"--calibrate"},
       "FILE",
       "measure this machine on the ranks hprun starts (the config's model on one rank, on every rank at once; "
       "collectives on groups of each size) and write the calibration to FILE",
       [](Args& a, const std::string& v) { a.calibrate_to = v; }},
      {{"--world"},
       "N",
       "plan a job of N ranks",
       [](Args& a, const std::string& v) { a.world = positive_int("--world", v); }},
      {{"--calibration"},
       "FILE",
       "the calibration (from --calibrate) that predicts step times",
       [](Args& a, const std::string& v) { a.calibration_path = v; }},
      {{"--memory-limit"},
       "GIB",
       "only layouts whose every rank fits in GIB GiB (with the allocator slack) rank first",
       [](Args& a, const std::string& v) { a.memory_limit_gib = hp::tools::memory_limit_gib(v); }},
      {{"--allocator-slack"},
       "FRACTION",
       "what the allocator holds beyond the tensors (default 0.1)",
       [](Args& a, const std::string& v) { a.allocator_slack = hp::tools::allocator_slack(v); }},
      {{"--routing"},
       "SPEC",
       "a mixture of experts' routing model in the dry runs (as hp-train --dry-run --routing)",
       [](Args& a, const std::string& v) { a.routing = hp::tools::routing_spec(v); }},
      {{"--schedules"},
       "LIST",
       "the pipeline schedules tried where pp > 1, comma-separated (default " + default_schedules() +
           "; available: " + hp::pp::schedule_names() + ")",
       [](Args& a, const std::string& v) {
         a.schedules.clear();
         for (size_t begin = 0;;) {
           const size_t comma = std::min(v.find(',', begin), v.size());
           const std::string name = v.substr(begin, comma - begin);
           if (hp::pp::schedule_stages(name, 1) == 0)
             throw hp::tools::UsageError("--schedules: '" + name +
                                         "' is not a schedule (available: " + hp::pp::schedule_names() + ")");
           if (std::find(a.schedules.begin(), a.schedules.end(), name) != a.schedules.end())
             throw hp::tools::UsageError("--schedules names " + name + " twice");
           a.schedules.push_back(name);
           if (comma == v.size()) break;
           begin = comma + 1;
         }
       }},
      {{"--top"},
       "K",
       "print the K best layouts (default 10)",
       [](Args& a, const std::string& v) { a.top = positive_int("--top", v); }},
      {{"--out"},
       "FILE",
       "write the best layout's config here (default plan.yaml)",
       [](Args& a, const std::string& v) {
         if (v.empty()) throw hp::tools::UsageError("--out needs a file name");
         a.out = v;
       }},
      {{"--json"},
       "FILE",
       "also write every layout, ranked, to FILE: its overrides, predicted step seconds, peak bytes",
       [](Args& a, const std::string& v) {
         if (v.empty()) throw hp::tools::UsageError("--json needs a file name");
         a.json_path = v;
       }},
      {{"--quiet"}, "", "no line per layout tried", [](Args& a, const std::string&) { a.quiet = true; }},
  };
  return table;
}

void usage(std::ostream& out) {
  out << "usage: hp-plan --config FILE [--set KEY=VALUE]... --world N [--calibration FILE] [--memory-limit GIB "
         "[--allocator-slack F]] [--routing SPEC] [--schedules LIST] [--top K] [--out FILE] [--json FILE] "
         "[--quiet]\n"
         "       hprun --nproc-per-node N hp-plan --config FILE [--set KEY=VALUE]... --calibrate FILE\n\n"
      << hp::tools::flag_help(flags());
}

std::string mib(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1 << 20);
  return out.str();
}

// Writes `text` to `path`, or throws naming the path.
void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  out.close();
  HP_CHECK(out.good(), "cannot write ", path);
}

int calibrate(const hp::train::TrainConfig& config, const std::string& path) {
  hp::comm::InitOptions init;
  init.group = hp::train::world_options(config);
  const hp::comm::ProcessGroup world = hp::comm::init_process_group(init);
  if (world.rank() == 0)
    std::cout << "hp-plan: calibrating on " << world.size() << " rank(s) at once: " << config.model->describe()
              << " on one rank, " << config.data.seq_len << " tokens per row\n";
  const hp::train::Calibration cal = hp::train::calibrate(config, world);
  if (world.rank() == 0) {
    write_file(path, cal.json() + "\n");
    std::cout << "hp-plan: the profiled steps, measured and as the calibration gives them:\n"
              << std::fixed << std::setprecision(1);
    for (const auto& p : cal.profile)
      std::cout << "  " << std::left << std::setw(30) << p.layout << std::right << std::setw(8) << p.seconds * 1e3
                << " ms  " << std::setw(8) << p.predicted * 1e3 << " ms\n";
    std::cout << "hp-plan: wrote " << path << "\n";
  }
  return 0;
}

int plan(const hp::train::TrainConfig& config, const Args& args) {
  hp::train::Calibration cal;
  const bool timed = !args.calibration_path.empty();
  if (timed) {
    cal = hp::train::Calibration::read(args.calibration_path);
    if (cal.ranks != args.world)
      std::cout << "hp-plan: note: the calibration was measured on " << cal.ranks
                << " rank(s) at once; this plan is for " << args.world << "\n";
  } else {
    std::cout << "hp-plan: no --calibration: layouts are checked for memory only, not timed\n";
  }
  hp::train::PlanOptions options;
  options.world_size = args.world;
  options.memory_limit_bytes = static_cast<int64_t>(args.memory_limit_gib * (1LL << 30));
  options.allocator_slack = args.allocator_slack;
  options.schedules = args.schedules;
  options.dry_run.routing = hp::train::RoutingModel::parse(args.routing);
  if (!args.quiet) options.progress = [](const std::string& line) { std::cout << "  " << line << "\n" << std::flush; };
  const std::vector<hp::train::PlannedLayout> ranked =
      timed ? hp::train::plan_layouts(config, cal, options) : hp::train::plan_layouts(config, options);
  HP_CHECK(!ranked.empty(), "no layout of ", config.model->describe(), " on ", args.world,
           " ranks is allowed by the config (batch, heads and layers must divide)");
  std::cout << "\n  #  layout" << std::string(52, ' ') << (timed ? "step ms   " : "") << "peak MiB  fits\n";
  for (size_t i = 0; i < ranked.size() && static_cast<int>(i) < args.top; ++i) {
    const auto& l = ranked[i];
    std::cout << std::setw(3) << i + 1 << "  " << std::left << std::setw(58) << l.describe() << std::right;
    if (timed) std::cout << std::setw(8) << std::fixed << std::setprecision(1) << l.estimate.seconds * 1e3 << "  ";
    std::cout << std::setw(9) << mib(l.peak_bytes) << "  " << (l.fits ? "yes" : "no") << "\n";
  }
  if (!args.json_path.empty()) {
    nlohmann::json all = nlohmann::json::array();
    for (const auto& l : ranked)
      all.push_back({{"layout", l.describe()},
                     {"overrides", l.overrides},
                     {"step_seconds", timed ? nlohmann::json(l.estimate.seconds) : nlohmann::json(nullptr)},
                     {"peak_bytes", l.peak_bytes},
                     {"fits", l.fits}});
    write_file(args.json_path, all.dump(1) + "\n");
  }
  const auto& best = ranked.front();
  if (!best.fits) {
    std::cout << "\nhp-plan: no layout fits in " << args.memory_limit_gib << " GiB; nothing written\n";
    return kFailed;
  }
  write_file(args.out, hp::train::to_json(best.config) + "\n");
  std::set<std::string> unpriced;
  for (const auto& l : ranked) unpriced.insert(l.estimate.unpriced.begin(), l.estimate.unpriced.end());
  if (const std::string warning = hp::train::unpriced_warning(unpriced); timed && !warning.empty())
    std::cout << "\nhp-plan: warning: " << warning << "\n";
  std::cout << "\nhp-plan: " << ranked.size() << " layouts; "
            << (timed ? "the fastest that fits, " : "the one of the smallest peak, ") << best.describe() << ", "
            << (timed ? best.estimate.str() : mib(best.peak_bytes) + " MiB") << ", is in " << args.out << "\n";
  return 0;
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
    if (args.calibrate_to.empty() == (args.world == 0))
      throw hp::tools::UsageError("give either --calibrate FILE (under hprun) or --world N (a plan)");
    if (!args.calibrate_to.empty() && !args.calibration_path.empty())
      throw hp::tools::UsageError("--calibration goes with --world, not --calibrate");
  } catch (const hp::tools::UsageError& e) {
    std::cerr << "hp-plan: " << e.what() << "\n\n";
    usage(std::cerr);
    return kUsageError;
  }
  hp::train::TrainConfig config;
  try {
    config = hp::train::load_config(args.config_path, args.overrides);
  } catch (const std::exception& e) {
    std::cerr << "hp-plan: error: " << e.what() << "\n";
    return kUsageError;
  }
  try {
    return args.calibrate_to.empty() ? plan(config, args) : calibrate(config, args.calibrate_to);
  } catch (const std::exception& e) {
    std::cerr << "hp-plan: failed: " << e.what() << "\n";
    return kFailed;
  }
}
