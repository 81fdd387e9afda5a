#include "train/plan.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "hp/core/error.h"
#include "hp/dtensor/local.h"
#include "hp/models/model_spec.h"
#include "hp/nn/moe.h"
#include "hp/train/cost_model.h"
#include "hp/train/dry_run.h"

namespace hp::train::detail {

namespace {

// Rank `report.rank`'s files in `dir`: the table, the JSON and the lifetimes.
void write_report(const DryRunReport& report, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string base = dir + "/rank_" + std::to_string(report.rank);
  for (const auto& [path, text] : {std::pair<std::string, std::string>{base + ".txt", report.table()},
                                   {base + ".json", report.json() + "\n"},
                                   {base + "_lifetimes.csv", report.lifetimes_csv}}) {
    std::ofstream out(path);
    out << text;
    HP_CHECK(out.good(), "hp-train --dry-run: cannot write ", path);
  }
}

}  // namespace

void print_plan(const TrainConfig& c, const comm::ProcessGroup& world, const DeviceMesh& mesh,
                const models::ModelParts& parts, const TrainOptions& options) {
  DryRunOptions dry;
  dry.routing = RoutingModel::parse(options.routing);
  dry.lifetimes = !options.report_dir.empty();
  const double memory_limit_gib = options.memory_limit_gib, allocator_slack = options.allocator_slack;
  // Per rank: parameters (local elements), parameter bytes, and its training memory: the dry run's
  // peak (hp/train/dry_run.h) where it covers the layout, else an estimate: parameters + gradients +
  // AdamW's two moments, plus the activations the model family estimates one micro-batch keeps.
  int64_t param_bytes = 0;  // of this rank's pieces, which have no storage yet
  for (const at::Tensor& p : parts.parameters()) {
    const at::Tensor& piece = local_tensor(p);
    param_bytes += piece.numel() * static_cast<int64_t>(piece.element_size());
  }
  double memory = 0.0;
  std::optional<StepTimeEstimate> step_time;  // with a calibration
  std::string not_covered, failure;
  try {
    const std::vector<DryRunReport> pipeline = dry_run_pipeline(c, world.size(), world.rank(), dry);
    const DryRunReport& report =
        *std::find_if(pipeline.begin(), pipeline.end(), [&](const DryRunReport& r) { return r.rank == world.rank(); });
    memory = static_cast<double>(report.peak_bytes);
    if (!options.report_dir.empty()) write_report(report, options.report_dir);
    if (!options.calibration.empty()) {
      std::vector<StepWork> work;
      for (const DryRunReport& r : pipeline) work.push_back(r.work);
      step_time = estimate_step_time(c, work, Calibration::read(options.calibration));
    }
  } catch (const std::exception& e) {  // every rank goes on to the gather below, whatever happened
    const std::string what = e.what();
    // A device the dry run does not predict gets an estimate; on the CPU it covers every layout,
    // and its failure is the run's (a capacity overflow) or the command's (a routing model that
    // does not fit the model).
    (c.train.device == "cpu" ? failure : not_covered) = what.substr(0, what.find('\n'));
    // A context-parallel rank keeps its 1/cp of each sequence.
    const double activations = static_cast<double>(c.train.micro_batch * c.data.seq_len / c.parallel.cp) *
                               c.model->activation_bytes_per_token(c.parallel);
    memory = 4.0 * param_bytes + activations;
  }
  // As DryRunReport::fits, in doubles (a limit of any size).
  constexpr double kGiB = static_cast<double>(int64_t{1} << 30);
  const double fits = memory * (1.0 + allocator_slack) <= memory_limit_gib * kGiB ? 1.0 : 0.0;
  at::Tensor mine = at::tensor({static_cast<double>(param_bytes / 4), static_cast<double>(param_bytes), memory, fits,
                                failure.empty() ? 0.0 : 1.0, step_time ? step_time->seconds : 0.0},
                               at::kDouble);
  const at::Tensor all = world.all_gather(mine).view({world.size(), 6});
  HP_CHECK(failure.empty(), failure);
  for (int r = 0; r < world.size(); ++r)
    HP_CHECK(all[r][4].item<double>() == 0.0, "the dry run of rank ", r, " failed (its error is on its output)");
  if (world.rank() != 0) return;
  std::cout << "plan: " << c.parallel.str() << " on " << world.size() << " ranks, " << mesh.str() << "\n"
            << "model: " << c.model->describe() << ": " << c.model->parameter_count() << " parameters\n"
            << "batch: " << c.train.global_batch << " sequences x " << c.data.seq_len << " tokens, "
            << c.per_rank_batch() << " per data-parallel rank in " << c.micro_batches() << " micro-batch(es)\n";
  if (!not_covered.empty()) {
    std::cout << "memory: estimated (" << not_covered << ")\n";
    if (c.memory.checkpoint != "none" || c.memory.swap != "none" || !c.memory.blocks.empty())
      std::cout << "activations: estimated as without memory.checkpoint, memory.swap and memory.blocks, which keep "
                   "less in the compute allocator (an upper bound)\n";
  } else {
    std::cout << "memory: each rank's step peak from a dry run on the meta device (docs/planning.md)";
    if (!nn::routers_of(*parts.model).empty())
      std::cout << ", its routers choosing by a " << dry.routing.str() << " routing model";
    std::cout << "\n";
  }
  std::ios saved_format(nullptr);
  saved_format.copyfmt(std::cout);
  std::ostringstream limit;  // as given
  limit << memory_limit_gib << " GiB";
  if (memory_limit_gib > 0.0)
    std::cout << "fits: each rank's memory plus " << 100.0 * allocator_slack << "% allocator slack against "
              << limit.str() << " per rank\n";
  const char* what = not_covered.empty() ? "dry-run peak " : "estimated training memory ";
  int over = 0;
  for (int r = 0; r < world.size(); ++r) {
    const auto row = all[r];
    std::cout << "  rank " << r << ": " << static_cast<int64_t>(row[0].item<double>()) << " parameter elements ("
              << std::fixed << std::setprecision(2) << row[1].item<double>() / 1e6 << " MB), " << what
              << row[2].item<double>() / 1e6 << " MB";
    if (memory_limit_gib > 0.0) {
      const bool fits_here = row[3].item<double>() > 0.0;
      over += fits_here ? 0 : 1;
      std::cout << std::setprecision(3) << "; with the slack " << row[2].item<double>() * (1.0 + allocator_slack) / kGiB
                << " GiB" << (fits_here ? ": fits" : ": does not fit");
    }
    std::cout << "\n";
  }
  if (memory_limit_gib > 0.0)
    std::cout << (over == 0 ? "all ranks fit"
                            : std::to_string(over) + " of " + std::to_string(world.size()) + " ranks do not fit")
              << " in " << limit.str() << "\n";
  if (step_time) {
    // The step waits for its slowest rank.
    double slowest = 0.0;
    for (int r = 0; r < world.size(); ++r) slowest = std::max(slowest, all[r][5].item<double>());
    std::cout << std::setprecision(1) << "step time: " << slowest * 1e3 << " ms predicted from " << options.calibration
              << " (rank 0: " << step_time->str() << "; docs/planning.md#the-cost-model)\n";
    if (const std::string warning = unpriced_warning(step_time->unpriced); !warning.empty())
      std::cout << "step time: warning: " << warning << "\n";
  }
  std::cout.copyfmt(saved_format);
}

}  // namespace hp::train::detail
