// bench/pp: measured pipeline bubbles of GPipe, 1F1B, interleaved 1F1B and ZBV next to theory, from
// timelines the executor records during real steps (ranks as threads, balanced layers, one CPU
// thread per rank). The bubble is 1 - (time ranks spend computing) / (ranks x step makespan).
// Writes the measured 1F1B and ZBV timelines as SVG (docs/images/pp_measured_*.svg with --docs).
//
//   build/bin/bench_pp [--quick] [--ranks P] [--docs]
//
// With more ranks than cores, ranks that wait free a core for the others, so measured bubbles come
// out below theory; run with P <= cores for numbers that mean what they say (the default, 2).
#include <ATen/ATen.h>

#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>

#include "hp/models/parallelize.h"
#include "hp/nn/init.h"
#include "hp/parallel/loss_parallel.h"
#include "hp/pp/executor.h"
#include "hp/testing/run_ranks.h"
#include "hp_build_paths.h"

namespace {

struct Measured {
  hp::pp::Simulation sim;  // timeline and bubble of the step with the median bubble
};

Measured measure(const hp::pp::Schedule& schedule, const hp::models::LlamaConfig& config, int64_t rows, int steps) {
  std::vector<hp::pp::Simulation> runs(steps);
  std::mutex mu;
  hp::testing::RunRanksOptions options;
  options.cpu_threads_per_rank = 1;
  hp::testing::run_ranks(schedule.ranks, [&](const hp::comm::ProcessGroup& world) {
    hp::models::Llama model(config);
    hp::nn::init_parameters(model, 1);
    const auto all = hp::models::split_llama(model, std::vector<int64_t>(schedule.stages, config.layers / schedule.stages));
    std::vector<hp::pp::PipelineStage> mine;
    for (int s = 0; s < schedule.stages; ++s)
      if (schedule.stage_rank[s] == world.rank()) mine.push_back({all[s], s});
    hp::pp::PipelineExecutor pipe(schedule, mine, world,
                                  [](const at::Tensor& l, const at::Tensor& t) { return hp::cross_entropy(l, t); });
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    const at::Tensor tokens = at::randint(0, config.vocab, {rows, config.max_seq + 1}, gen, at::TensorOptions().dtype(at::kLong));
    const at::Tensor x = tokens.narrow(1, 0, config.max_seq).contiguous(), y = tokens.narrow(1, 1, config.max_seq).contiguous();
    pipe.step(x, y);  // warm-up
    pipe.record_timeline(true);
    for (int i = 0; i < steps; ++i) {
      world.barrier();
      for (auto& p : model.parameters()) p.mutable_grad() = at::Tensor();
      pipe.step(x, y);
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& t : pipe.last_timeline()) runs[i].timeline.push_back(t);
    }
  }, options);
  for (auto& run : runs) {  // times relative to the step's first action; bubble over compute actions
    double start = 1e300, end = 0, busy = 0;
    for (const auto& t : run.timeline) start = std::min(start, t.start), end = std::max(end, t.end);
    for (auto& t : run.timeline) {
      t.start -= start, t.end -= start;
      if (t.action.is_compute()) busy += t.end - t.start;
    }
    run.makespan = end - start;
    run.bubble = 1.0 - busy / (schedule.ranks * run.makespan);
  }
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.bubble < b.bubble; });
  return {runs[runs.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, docs = false;
  int p = 2;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--docs")) docs = true;
    else if (!std::strcmp(argv[i], "--ranks") && i + 1 < argc) p = std::atoi(argv[++i]);
  }
  const int m = quick ? 4 : 8, v = 2, steps = quick ? 1 : 5;
  // Micro-batches large enough that an action computes for milliseconds: per-message latency
  // (a Gloo loopback round trip, 0.1 to 1 ms) then weighs little, as it does on real stages.
  hp::models::LlamaConfig config{256, quick ? 64 : 192, 4 * p, 4, 2, quick ? 128 : 512, quick ? 16 : 128};
  const int64_t rows = (quick ? 2 : 4) * m;
  std::cout << "bench_pp: " << p << " ranks, " << m << " micro-batches of " << rows / m << " x " << config.max_seq
            << " tokens, Llama dim " << config.dim << " with " << config.layers << " layers split evenly\n"
            << std::fixed << std::setprecision(1)
            << "schedule          measured bubble   theory (unit costs)   simulated with measured costs\n";
  struct Row {
    hp::pp::Schedule schedule;
    double theory;
  };
  const std::vector<Row> rows_ = {
      {hp::pp::gpipe(p, m), (p - 1.0) / (m + p - 1.0)},
      {hp::pp::one_f_one_b(p, m), (p - 1.0) / (m + p - 1.0)},
      {hp::pp::interleaved_1f1b(p, v, m), (p - 1.0) / (v * m + p - 1.0)},
      {hp::pp::zero_bubble_v(p, m), hp::pp::simulate(hp::pp::zero_bubble_v(p, m)).bubble},
  };
  // Mean F / I / W times of a measured timeline (a full B counts half to each of I and W).
  const auto mean_costs = [](const hp::pp::Simulation& sim) {
    double f = 0, i = 0, w = 0, nf = 0, ni = 0, nw = 0;
    for (const auto& t : sim.timeline) {
      const double d = t.end - t.start;
      switch (t.action.kind) {
        case hp::pp::ActionKind::kForward: f += d, ++nf; break;
        case hp::pp::ActionKind::kBackward: i += d / 2, w += d / 2, ++ni, ++nw; break;
        case hp::pp::ActionKind::kBackwardInput: i += d, ++ni; break;
        case hp::pp::ActionKind::kBackwardWeight: w += d, ++nw; break;
        default: break;
      }
    }
    return hp::pp::ActionCosts{f / nf, i / ni, w / nw, 0.0};
  };
  const auto report = [&](const hp::pp::Schedule& schedule, const std::string& name, double theory) {
    const Measured got = measure(schedule, config, rows, steps);
    const hp::pp::ActionCosts costs = mean_costs(got.sim);
    // The same schedule replayed with this run's mean action costs: what the schedule alone predicts.
    const double predicted = hp::pp::simulate(schedule, costs).bubble;
    std::cout << std::left << std::setw(18) << name << std::right << std::setw(14) << 100 * got.sim.bubble << "%"
              << std::setw(20) << 100 * theory << "%" << std::setw(24) << 100 * predicted << "%\n";
    if (docs && (name == "1F1B" || name == "ZBV (costs)")) {
      const std::string path = std::string(HP_SOURCE_DIR) + "/docs/images/pp_measured_" +
                               (name == "1F1B" ? "1f1b" : "zbv") + ".svg";
      std::ofstream(path) << hp::pp::to_svg(schedule, got.sim, schedule.name + " (measured)");
      std::cout << "  wrote " << path << "\n";
    }
    return got;
  };
  for (const auto& row : rows_) {
    const Measured got = report(row.schedule, row.schedule.name, row.theory);
    if (row.schedule.name != "ZBV") continue;
    // Profile, then schedule (as the zero-bubble paper does): ZBV rebuilt with the F / I / W costs
    // just measured, whose I is dearer than its W here (attention's backward has no weights).
    const hp::pp::ActionCosts costs = mean_costs(got.sim);
    std::cout << std::setprecision(2) << "  measured mean costs: F " << 1e3 * costs.forward << " ms, I "
              << 1e3 * costs.backward_input << " ms, W " << 1e3 * costs.backward_weight << " ms\n"
              << std::setprecision(1);
    const hp::pp::Schedule tuned = hp::pp::zero_bubble_v(p, m, costs);
    report(tuned, "ZBV (costs)", hp::pp::simulate(tuned, costs).bubble);
  }
  return 0;
}
