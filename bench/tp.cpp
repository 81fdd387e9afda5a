// bench/tp: tensor parallelism on the test Llama, measured side by side in one run.
//
//   build/bin/bench_tp [--quick]
//
// 1. Communication per layer per training step at TP=2, with and without sequence parallel:
//    collectives counted by CommDebugMode over one step of a 2-layer and a 4-layer model; half the
//    difference is what one layer costs, compared with the theory (Megatron-LM): without SP, 4
//    all_reduces of the activation [batch, seq, dim] per layer (2 forward, 2 backward); with SP,
//    4 all_gathers and 4 reduce_scatters of it.
// 2. Step time (forward, backward, AdamW) at TP=2 (two ranks as threads, sequence and loss
//    parallel) versus one rank, and TP=2 with async TP (gathers and reduce-scatters fused with the
//    matmuls through symmetric memory) versus plain TP=2 (the shared-memory transport's
//    collectives); every rank with one CPU thread (ATen and OpenBLAS), rounds alternating, medians.
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstring>
#include <map>

#include "bench/timing.h"
#include "hp/comm/comm_debug_mode.h"
#include "hp/core/cpu_threads.h"
#include "hp/nn/init.h"
#include "hp/parallel/loss_parallel.h"
#include "hp/testing/run_ranks.h"
#include "tests/tp/llama_model.h"
#include "tests/tp/llama_plan.h"

namespace {

using hp::bench::median;
using hp::bench::seconds;
using hp::test::Llama;
using hp::test::LlamaConfig;

struct Shape {
  LlamaConfig model;
  int64_t batch, seq;
};

Shape shape(bool quick, int64_t layers) {
  LlamaConfig c;
  c.vocab = quick ? 256 : 2048;
  c.dim = quick ? 64 : 256;
  c.heads = 8;
  c.kv_heads = 4;
  c.ffn_hidden = quick ? 128 : 768;
  c.layers = layers;
  c.max_seq = 128;
  return {c, quick ? 2 : 4, quick ? 32 : 128};
}

std::pair<at::Tensor, at::Tensor> batch(const Shape& s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor seq = at::randint(0, s.model.vocab, {s.batch, s.seq + 1}, gen, at::TensorOptions().dtype(at::kLong));
  return {seq.narrow(1, 0, s.seq).contiguous(), seq.narrow(1, 1, s.seq).contiguous()};
}

struct Trainer {
  Llama model;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  at::Tensor tokens, targets;
  Trainer(const Shape& s, const hp::DeviceMesh* mesh, hp::test::TpOptions tp) : model(s.model) {
    if (mesh) hp::parallelize_module(model, *mesh, hp::test::llama_tp_plan(tp));
    hp::nn::init_parameters(model, 7);
    optimizer = std::make_unique<torch::optim::AdamW>(model.parameters(), torch::optim::AdamWOptions(1e-3));
    std::tie(tokens, targets) = batch(s);
  }
  void step() {
    optimizer->zero_grad();
    hp::cross_entropy(model(tokens), targets).backward();
    optimizer->step();
  }
};

struct Tally {
  std::map<std::string, std::pair<double, double>> ops;  // op -> (count, bytes)
};

// Collectives rank 0 issues in one step (after a warm-up step) of a TP=2 model with `layers`.
Tally step_comm(bool quick, int64_t layers, bool sp) {
  Tally t;
  hp::testing::run_ranks(2, [&](const hp::comm::ProcessGroup& world) {
    hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {2}, {"tp"});
    Trainer trainer(shape(quick, layers), &mesh, {sp, /*loss_parallel=*/true});
    trainer.step();
    hp::comm::CommDebugMode comm;
    trainer.step();
    if (world.rank() != 0) return;
    for (const char* op : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})
      t.ops[op] = {static_cast<double>(comm.count(op)), static_cast<double>(comm.bytes(op))};
  });
  return t;
}

// Per-layer communication, measured and theoretical; returns measured / theoretical bytes.
double report_comm(bool quick, bool sp) {
  const Tally two = step_comm(quick, 2, sp), four = step_comm(quick, 4, sp);
  const Shape s = shape(quick, 2);
  const double activation = static_cast<double>(s.batch * s.seq * s.model.dim * 4);
  // Bytes this rank puts in: all_reduce and reduce_scatter the whole activation, all_gather its half.
  const std::map<std::string, std::pair<double, double>> theory =
      sp ? std::map<std::string, std::pair<double, double>>{{"all_gather", {4, 4 * activation / 2}},
                                                            {"reduce_scatter", {4, 4 * activation}}}
         : std::map<std::string, std::pair<double, double>>{{"all_reduce", {4, 4 * activation}}};
  double measured_bytes = 0, theory_bytes = 0;
  std::printf("\nper layer per step, TP=2%s (activation %.0f KiB)\n", sp ? ", sequence parallel" : "",
              activation / 1024);
  std::printf("%-16s %10s %10s %14s %14s\n", "collective", "count", "theory", "KiB", "theory KiB");
  for (const auto& [op, counts] : four.ops) {
    const double count = (counts.first - two.ops.at(op).first) / 2, bytes = (counts.second - two.ops.at(op).second) / 2;
    const auto want = theory.count(op) ? theory.at(op) : std::pair<double, double>{0, 0};
    if (count == 0 && want.first == 0) continue;
    std::printf("%-16s %10.1f %10.0f %14.1f %14.1f\n", op.c_str(), count, want.first, bytes / 1024, want.second / 1024);
    measured_bytes += bytes;
    theory_bytes += want.second;
  }
  return measured_bytes / theory_bytes;
}

struct StepTimes {
  double one, tp2, tp2_async, tp2_async_apart;  // median seconds
};

// Rank 0's step times at TP=2 with `tp`, after a warm-up step.
std::vector<double> tp2_steps(const Shape& s, int steps, hp::test::TpOptions tp) {
  std::vector<double> mine;
  hp::testing::run_ranks(2, [&](const hp::comm::ProcessGroup& world) {
    hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {2}, {"tp"});
    Trainer trainer(s, &mesh, tp);
    trainer.step();
    for (int i = 0; i < steps; ++i) {
      const double t = seconds([&] { trainer.step(); });
      if (world.rank() == 0) mine.push_back(t);
    }
  });
  return mine;
}

// Median step seconds at one rank, at TP=2, and at TP=2 with async TP (q/k/v and gate/up sharing
// a gather, and each gathering its own), rounds alternating.
StepTimes step_times(bool quick) {
  const Shape s = shape(quick, 2);
  const int rounds = quick ? 1 : 5, steps = quick ? 2 : 5;
  std::vector<double> one, tp2, tp2_async, tp2_async_apart;
  for (int r = 0; r < rounds; ++r) {
    {
      Trainer trainer(s, nullptr, {});
      trainer.step();
      for (int i = 0; i < steps; ++i) one.push_back(seconds([&] { trainer.step(); }));
    }
    for (const auto& [into, async, shared] : {std::tuple{&tp2, false, true}, std::tuple{&tp2_async, true, true},
                                              std::tuple{&tp2_async_apart, true, false}}) {
      hp::test::TpOptions options{true, true, hp::comm::WireFormat::kNative, async};
      options.share_input_gathers = shared;
      const std::vector<double> mine = tp2_steps(s, steps, options);
      into->insert(into->end(), mine.begin(), mine.end());
    }
  }
  return {median(one), median(tp2), median(tp2_async), median(tp2_async_apart)};
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && !std::strcmp(argv[1], "--quick");
  hp::set_cpu_threads(1);  // one core per rank: the single rank and each TP rank alike
  const Shape s = shape(quick, 2);
  std::printf("model: dim %ld, heads %ld (kv %ld), ffn %ld, vocab %ld; batch %ld x seq %ld; fp32\n", s.model.dim,
              s.model.heads, s.model.kv_heads, s.model.ffn_hidden, s.model.vocab, s.batch, s.seq);
  const double no_sp = report_comm(quick, false);
  const double with_sp = report_comm(quick, true);
  const StepTimes t = step_times(quick);
  std::printf(
      "\nstep time (2 layers, 1 intra-op thread per rank): 1 rank %.2f ms, TP=2 %.2f ms, TP=2 async %.2f ms, TP=2 "
      "async with a gather per layer %.2f ms\n",
      t.one * 1e3, t.tp2 * 1e3, t.tp2_async * 1e3, t.tp2_async_apart * 1e3);
  std::printf(
      "ratios: per-layer bytes measured/theory without SP %.2f, with SP %.2f; step time TP=2 / 1 rank %.2f, "
      "TP=2 async / TP=2 %.2f, TP=2 async with a gather per layer / TP=2 %.2f\n",
      no_sp, with_sp, t.tp2 / t.one, t.tp2_async / t.tp2, t.tp2_async_apart / t.tp2);
}
