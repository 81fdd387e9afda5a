// bench/pp: measured pipeline bubbles of GPipe, 1F1B, interleaved 1F1B and ZBV next to theory, from
// timelines the executor records during real steps (ranks as threads, balanced layers, one CPU
// thread per rank). The bubble is 1 - (time ranks spend computing) / (ranks x step makespan).
//
//   build/bin/bench_pp [--quick] [--docs]
//
// Two setups, each with the same model on the same ranks for every schedule:
// - accelerator-bound, 4 ranks: each layer's forward, input gradient and weight gradient idle the
//   CPU for a fixed "device time" after their real (small) computation, as a rank does while its
//   GPU runs the kernels. This machine has 2 cores, so 4 CPU-bound ranks would share them and
//   time each other's waits; idle device time does not. GPipe and 1F1B run 4 stages of 2 layers,
//   interleaved 1F1B and ZBV 8 stages of 1 layer (2 per rank).
// - CPU-bound, 2 ranks: the stages' real computation only, one core per rank.
// Batched P2P (PipelineOptions::batch_p2p) is on, except in the rows marked "unbatched".
// --docs writes the accelerator-bound 1F1B and ZBV timelines as SVG (docs/images/pp_measured_*.svg).
#include <ATen/ATen.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <thread>

#include "hp/core/lambda_backward.h"
#include "hp/models/llama/parallelize.h"
#include "hp/models/llama/pipeline.h"
#include "hp/nn/init.h"
#include "hp/parallel/loss_parallel.h"
#include "hp/pp/executor.h"
#include "hp/testing/run_ranks.h"
#include "hp_build_paths.h"

namespace {

void idle(double seconds) { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); }

// A stage on a stand-in accelerator: the stage's computation, then `seconds` of device time in its
// forward, in its input gradient (a node on the input path) and in its weight gradient (a node on
// a branch to the `device` parameter, which W restarts), the CPU idle meanwhile. Values and
// gradients are the stage's own.
struct OnDevice : hp::nn::Module {
  OnDevice(std::shared_ptr<hp::nn::Module> stage, double seconds)
      : hp::nn::Module("OnDevice"), stage(register_module("stage", std::move(stage))), seconds(seconds) {
    device = register_parameter("device", at::zeros({1}));
  }
  at::Tensor forward(const at::Tensor& x) override {
    const at::Tensor y = (*stage)(x);
    idle(seconds);
    const double s = seconds;
    at::Tensor out = hp::record_backward("device_input_gradient", y, y.detach().clone(), [s](const at::Tensor& grad) {
      idle(s);
      return grad;
    });
    at::Tensor zero =
        hp::record_backward("device_weight_gradient", device, at::zeros({1}, y.options()), [s](const at::Tensor& grad) {
          idle(s);
          return grad.sum().reshape({1}) * 0;
        });
    return out + zero;
  }
  std::shared_ptr<hp::nn::Module> stage;
  at::Tensor device;
  double seconds;
};

struct Setup {
  std::string name;
  int ranks;
  hp::models::LlamaConfig config;
  int micro_batches;
  int64_t rows;                 // per step
  double device_seconds = 0.0;  // per layer, in each of F, I and W
  int steps;
};

hp::pp::Simulation measure(const Setup& setup, const hp::pp::Schedule& schedule, bool batch_p2p) {
  std::vector<hp::pp::Simulation> runs(setup.steps);
  hp::testing::RunRanksOptions options;
  options.cpu_threads_per_rank = 1;
  const int64_t layers_per_stage = setup.config.layers / schedule.stages;
  hp::testing::run_ranks(
      schedule.ranks,
      [&](const hp::comm::ProcessGroup& world) {
        hp::models::Llama model(setup.config);
        hp::nn::init_parameters(model, 1);
        const auto all = hp::models::split_llama(model, std::vector<int64_t>(schedule.stages, layers_per_stage));
        std::vector<hp::pp::PipelineStage> mine;
        for (int s = 0; s < schedule.stages; ++s) {
          if (schedule.stage_rank[s] != world.rank()) continue;
          std::shared_ptr<hp::nn::Module> stage = all[s];
          if (setup.device_seconds > 0)
            stage = std::make_shared<OnDevice>(stage, setup.device_seconds * static_cast<double>(layers_per_stage));
          mine.push_back({stage, s});
        }
        hp::pp::PipelineOptions pipeline;
        pipeline.batch_p2p = batch_p2p;
        hp::pp::PipelineExecutor pipe(
            schedule, mine, world, [](const at::Tensor& l, const at::Tensor& t) { return hp::cross_entropy(l, t); },
            pipeline);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
        const int64_t seq = setup.config.max_seq;
        const at::Tensor tokens =
            at::randint(0, setup.config.vocab, {setup.rows, seq + 1}, gen, at::TensorOptions().dtype(at::kLong));
        const at::Tensor x = tokens.narrow(1, 0, seq).contiguous(), y = tokens.narrow(1, 1, seq).contiguous();
        pipe.step(x, y);  // warm-up (and the shapes cross once)
        pipe.record_timeline(true);
        for (int i = 0; i < setup.steps; ++i) {
          world.barrier();
          for (const auto& st : mine)
            for (auto& p : st.module->parameters()) p.mutable_grad() = at::Tensor();
          pipe.step(x, y);
          hp::pp::Simulation step = pipe.measured_step();  // collective
          if (world.rank() == 0) runs[i] = std::move(step);
        }
      },
      options);
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.bubble < b.bubble; });
  return runs[runs.size() / 2];  // the step with the median bubble
}

void run_setup(const Setup& setup, bool docs) {
  const int p = setup.ranks, m = setup.micro_batches, v = 2;
  std::cout << "\n"
            << setup.name << ": " << p << " ranks, " << m << " micro-batches of " << setup.rows / m << " x "
            << setup.config.max_seq << " tokens, Llama dim " << setup.config.dim << ", " << setup.config.layers
            << " layers split evenly";
  if (setup.device_seconds > 0)
    std::cout << ", " << 1e3 * setup.device_seconds << " ms of device time per layer in each of F, I, W";
  std::cout << "\n"
            << std::fixed << std::setprecision(1)
            << "schedule                 measured bubble   theory (unit costs)   simulated with measured costs\n";
  const auto report = [&](const hp::pp::Schedule& schedule, const std::string& name, double theory, bool batch_p2p) {
    const hp::pp::Simulation got = measure(setup, schedule, batch_p2p);
    // The same schedule replayed with this run's mean action costs and send latency: what the
    // schedule alone predicts.
    const double predicted = hp::pp::simulate(schedule, hp::pp::measured_costs(got)).bubble;
    std::cout << std::left << std::setw(25) << name << std::right << std::setw(14) << 100 * got.bubble << "%"
              << std::setw(20) << 100 * theory << "%" << std::setw(24) << 100 * predicted << "%\n";
    if (docs && batch_p2p && (name == "1F1B" || name == "ZBV")) {
      const std::string path =
          std::string(HP_SOURCE_DIR) + "/docs/images/pp_measured_" + (name == "1F1B" ? "1f1b" : "zbv") + ".svg";
      std::ofstream(path) << hp::pp::to_svg(schedule, got, schedule.name + " (measured, " + setup.name + ")");
      std::cout << "  wrote " << path << "\n";
    }
    return got;
  };
  const double one_f_one_b_theory = (p - 1.0) / (m + p - 1.0);
  report(hp::pp::gpipe(p, m), "GPipe", one_f_one_b_theory, true);
  report(hp::pp::one_f_one_b(p, m), "1F1B", one_f_one_b_theory, true);
  report(hp::pp::one_f_one_b(p, m), "1F1B unbatched", one_f_one_b_theory, false);
  report(hp::pp::interleaved_1f1b(p, v, m), "Interleaved1F1B", (p - 1.0) / (v * m + p - 1.0), true);
  report(hp::pp::zero_bubble_h1(p, m), "ZB-H1", hp::pp::simulate(hp::pp::zero_bubble_h1(p, m)).bubble, true);
  report(hp::pp::zero_bubble_h2(p, m), "ZB-H2", hp::pp::simulate(hp::pp::zero_bubble_h2(p, m)).bubble, true);
  report(hp::pp::v_half(p, m), "V-Half", hp::pp::simulate(hp::pp::v_half(p, m)).bubble, true);
  report(hp::pp::v_min(p, m), "V-Min", hp::pp::simulate(hp::pp::v_min(p, m)).bubble, true);
  const hp::pp::Schedule zbv = hp::pp::zero_bubble_v(p, m);
  const hp::pp::Simulation got = report(zbv, "ZBV", hp::pp::simulate(zbv).bubble, true);
  report(zbv, "ZBV unbatched", hp::pp::simulate(zbv).bubble, false);
  // Profile, then schedule (as the zero-bubble paper does): ZBV rebuilt with the F / I / W costs
  // just measured.
  const hp::pp::ActionCosts costs = hp::pp::measured_costs(got);
  std::cout << std::setprecision(2) << "  ZBV's measured mean costs: F " << 1e3 * costs.forward << " ms, I "
            << 1e3 * costs.backward_input << " ms, W " << 1e3 * costs.backward_weight << " ms, send "
            << 1e3 * costs.send << " ms, overhead " << 1e3 * costs.overhead << " ms per action\n"
            << std::setprecision(1);
  const hp::pp::Schedule tuned = hp::pp::zero_bubble_v(p, m, costs);
  const double predicted = hp::pp::simulate(tuned, costs).bubble;
  const hp::pp::Simulation tuned_run = report(tuned, "ZBV (order from costs)", hp::pp::simulate(tuned).bubble, true);
  const double replay = hp::pp::simulate(tuned, hp::pp::measured_costs(tuned_run)).bubble;
  const auto gap = [&](double prediction) { return 100 * std::abs(tuned_run.bubble - prediction) / prediction; };
  std::cout << "  ZBV ordered for the measured costs: measured " << 100 * tuned_run.bubble
            << "%; simulated with this run's costs " << 100 * replay << "% (relative gap " << std::setprecision(0)
            << gap(replay) << "%, target <= 10%), with the first run's " << std::setprecision(1) << 100 * predicted
            << "% (" << std::setprecision(0) << gap(predicted) << "%)\n"
            << std::setprecision(1);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, docs = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--docs"))
      docs = true;
  }
  const int m = quick ? 4 : 8, steps = quick ? 1 : 5;
  std::cout << "bench_pp: median step of " << steps << "\n";
  // Accelerator-bound: small layers (their CPU time is a small part of each action), 8 ms of device
  // time per layer and action, so per-message latency weighs what it would next to real kernels.
  run_setup({"accelerator-bound", 4, hp::models::LlamaConfig{256, 64, 8, 4, 2, 128, 16}, m, 2 * m,
             quick ? 0.0005 : 0.008, steps},
            docs);
  // CPU-bound: micro-batches large enough that an action computes for milliseconds.
  run_setup(
      {"CPU-bound", 2, hp::models::LlamaConfig{256, quick ? 64 : 192, 8, 4, 2, quick ? 128 : 512, quick ? 16 : 128}, m,
       (quick ? 2 : 4) * m, 0.0, steps},
      /*docs=*/false);
  return 0;
}
