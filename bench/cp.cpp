// bench/cp: context parallelism's attention, measured side by side in one run.
//
//   build/bin/bench_cp [--quick]
//
// Causal core attention (hp::nn::CoreAttention, the module hp-train's Llama calls), forward and
// backward, fp32: batch 1, 8 query heads, 4 key/value heads, head dim 64, a sequence of 4096 tokens
// (512 with --quick). CP 1 runs on one rank with one CPU thread; CP W on W ranks (threads of this
// process, one CPU thread each, real Gloo groups), each holding its cp_shard of the sequence. A
// step's time is the slowest rank's (ranks meet in a barrier before each step); rounds alternate
// the modes, medians per mode. Peak bytes: the most one rank's compute allocator held during a step
// (hp::MemoryTracker), against CP 1, read two ways: with q, k and v made inside the step and let go
// by the caller after the call, as a model's projections make them (what attention keeps of them
// counts: Ulysses keeps its gathered copy, the ring the caller's), and with q, k and v held by the
// caller throughout (not counted).
//
// On a 2-core machine W 2 has a core per rank; W 4 shares the cores (its times show communication
// patterns, not speed-ups). Printed last: causal balanced / unbalanced step time at W 2 (target
// <= 0.8, issue [CP]), ring with overlap / without, and peak per rank / CP 1; then Llama's attention
// layer at W 2 with the asynchronous variant against without (run_async_layers).
#include <ATen/ATen.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/timing.h"
#include "hp/core/cpu_threads.h"
#include "hp/core/memory_tracker.h"
#include "hp/mesh/device_mesh.h"
#include "hp/models/llama/model.h"
#include "hp/nn/attention.h"
#include "hp/nn/init.h"
#include "hp/parallel/context_parallel.h"
#include "hp/testing/run_ranks.h"

namespace {

struct Problem {
  at::Tensor q, k, v, dout;
};

Problem make_problem(int64_t seq) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  return {at::randn({1, 8, seq, 64}, gen), at::randn({1, 4, seq, 64}, gen), at::randn({1, 4, seq, 64}, gen),
          at::randn({1, 8, seq, 64}, gen)};
}

// Forward and backward of `core` on leaves made from q, k, v; returns the step's peak bytes. With
// `inputs_made_inside`, attention gets copies of the leaves, which the caller lets go after the call.
int64_t step(hp::nn::CoreAttention& core, const Problem& p, bool inputs_made_inside = true) {
  const at::Tensor q = p.q.detach().requires_grad_(), k = p.k.detach().requires_grad_(),
                   v = p.v.detach().requires_grad_();
  hp::MemoryTracker tracker;
  // The clones are let go at the end of the statement.
  const at::Tensor out = inputs_made_inside ? core.call({q.clone(), k.clone(), v.clone()}) : core.call({q, k, v});
  out.backward(p.dout);
  return tracker.peak();
}

// The largest rank's step peak, on rank 0.
int64_t largest(const hp::comm::ProcessGroup& world, int64_t bytes) {
  const at::Tensor peak = at::tensor({static_cast<double>(bytes)}, at::kDouble);
  world.all_reduce(peak, {hp::comm::ReduceOp::kMax});
  return static_cast<int64_t>(peak.item<double>());
}

struct Mode {
  std::string name;
  hp::CpMode mode;
  bool balanced = true;
  bool overlap = true;
  int64_t ulysses = 0;
};

struct Measured {
  std::vector<double> seconds;  // the slowest rank's, per round
  int64_t peak = 0;             // the largest rank's, q, k, v made inside the step
  int64_t peak_held = 0;        // the same, q, k, v held by the caller
};

// Every mode on `ranks` ranks, rounds alternating the modes.
std::map<std::string, Measured> run_modes(int ranks, const std::vector<Mode>& modes, const Problem& global,
                                          int rounds) {
  std::map<std::string, Measured> out;
  hp::testing::RunRanksOptions options;
  options.cpu_threads_per_rank = 1;
  hp::testing::run_ranks(
      ranks,
      [&](const hp::comm::ProcessGroup& world) {
        const hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {ranks}, {"cp"});
        std::vector<std::shared_ptr<hp::nn::CoreAttention>> cores;
        std::vector<Problem> local;
        for (const Mode& m : modes) {
          cores.push_back(std::make_shared<hp::nn::CoreAttention>());
          hp::ContextParallel()
              .set_mode(m.mode)
              .set_load_balance(m.balanced)
              .set_ulysses_degree(m.ulysses)
              .set_ring_overlap(m.overlap)
              .apply(*cores.back(), "core", mesh);
          auto shard = [&](const at::Tensor& t) { return hp::cp_shard(t, 2, ranks, world.rank(), m.balanced); };
          local.push_back({shard(global.q), shard(global.k), shard(global.v), shard(global.dout)});
          const int64_t peak = largest(world, step(*cores.back(), local.back()));
          const int64_t peak_held = largest(world, step(*cores.back(), local.back(), false));
          if (world.rank() == 0) {
            out[m.name].peak = peak;
            out[m.name].peak_held = peak_held;
          }
        }
        for (int r = 0; r < rounds; ++r)
          for (size_t i = 0; i < modes.size(); ++i) {
            world.barrier();
            const at::Tensor t = at::tensor({hp::bench::seconds([&] { step(*cores[i], local[i]); })}, at::kDouble);
            world.all_reduce(t, {hp::comm::ReduceOp::kMax});
            if (world.rank() == 0) out[modes[i].name].seconds.push_back(t.item<double>());
          }
      },
      options);
  return out;
}

// The asynchronous variant needs the model around attention: Llama's attention layer (projections,
// rotary embedding, core attention, output projection; dim 512, 8 heads, 4 key/value heads), forward
// and backward on W 2 ranks, with each mode's exchange of K and V started at the call or as soon as
// K and V are computed (ContextParallel::set_async), rounds alternating.
std::map<std::string, Measured> run_async_layers(int64_t seq, int rounds) {
  hp::models::LlamaConfig config;
  config.dim = 512;
  config.max_seq = seq;
  constexpr int kRanks = 2;
  struct Layer {
    std::string name;
    hp::CpMode mode;
    bool async;
  };
  const std::vector<Layer> layers = {{"ring", hp::CpMode::kRing, false},
                                     {"ring async", hp::CpMode::kRing, true},
                                     {"ulysses", hp::CpMode::kUlysses, false},
                                     {"ulysses async", hp::CpMode::kUlysses, true}};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
  const at::Tensor x = at::randn({1, seq, config.dim}, gen), dy = at::randn({1, seq, config.dim}, gen);
  std::map<std::string, Measured> out;
  hp::testing::RunRanksOptions options;
  options.cpu_threads_per_rank = 1;
  hp::testing::run_ranks(
      kRanks,
      [&](const hp::comm::ProcessGroup& world) {
        const hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {kRanks}, {"cp"});
        std::vector<std::shared_ptr<hp::models::Attention>> attention;
        for (const Layer& l : layers) {
          attention.push_back(std::make_shared<hp::models::Attention>(config));
          hp::nn::init_parameters(*attention.back(), 5);
          hp::ContextParallel().set_mode(l.mode).set_async(l.async).apply(*attention.back()->core, "core", mesh);
        }
        const at::Tensor local_x = hp::cp_shard(x, 1, kRanks, world.rank()),
                         local_dy = hp::cp_shard(dy, 1, kRanks, world.rank());
        for (int r = 0; r < rounds; ++r)
          for (size_t i = 0; i < layers.size(); ++i) {
            world.barrier();
            const double seconds = hp::bench::seconds([&] {
              const at::Tensor input = local_x.detach().requires_grad_();
              (*attention[i])(input).backward(local_dy);
            });
            const at::Tensor t = at::tensor({seconds}, at::kDouble);
            world.all_reduce(t, {hp::comm::ReduceOp::kMax});
            if (world.rank() == 0) out[layers[i].name].seconds.push_back(t.item<double>());
          }
      },
      options);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int rounds = quick ? 2 : 5;
  const int64_t seq = quick ? 512 : 4096;
  const Problem global = make_problem(seq);

  hp::set_cpu_threads(1);
  hp::nn::CoreAttention single;
  Measured one;
  one.peak = step(single, global);
  one.peak_held = step(single, global, false);
  for (int r = 0; r < rounds; ++r) one.seconds.push_back(hp::bench::seconds([&] { step(single, global); }));

  using hp::CpMode;
  const std::vector<Mode> two = {{"ring", CpMode::kRing},
                                 {"ring unbalanced", CpMode::kRing, false},
                                 {"ring no overlap", CpMode::kRing, true, false},
                                 {"allgather", CpMode::kAllGather},
                                 {"ulysses", CpMode::kUlysses}};
  const std::vector<Mode> four = {{"ring", CpMode::kRing},
                                  {"allgather", CpMode::kAllGather},
                                  {"ulysses", CpMode::kUlysses},
                                  {"hybrid 2x2", CpMode::kHybrid, true, true, 2}};
  const std::map<std::string, Measured> w2 = run_modes(2, two, global, rounds);
  const std::map<std::string, Measured> w4 = run_modes(4, four, global, rounds);

  std::printf("causal attention fwd+bwd, batch 1, 8 heads (4 kv), head dim 64, %lld tokens, fp32; median of %d\n",
              static_cast<long long>(seq), rounds);
  std::printf("peak: q, k, v made inside the step (as projections make them) / held by the caller\n");
  std::printf("%-22s %12s %14s %12s %14s\n", "mode", "step (ms)", "peak/rank (MB)", "peak / cp 1", "held: / cp 1");
  const auto row = [&](const std::string& name, const Measured& m) {
    std::printf("%-22s %12.1f %14.2f %12.3f %14.3f\n", name.c_str(), 1e3 * hp::bench::median(m.seconds), m.peak / 1e6,
                static_cast<double>(m.peak) / static_cast<double>(one.peak),
                static_cast<double>(m.peak_held) / static_cast<double>(one.peak_held));
  };
  row("cp 1", one);
  for (const Mode& m : two) row("cp 2 " + m.name, w2.at(m.name));
  for (const Mode& m : four) row("cp 4 " + m.name, w4.at(m.name));
  const auto t = [](const Measured& m) { return hp::bench::median(m.seconds); };
  std::printf("cp 2 ring, causal balanced / unbalanced step time = %.3f (target <= 0.8)\n",
              t(w2.at("ring")) / t(w2.at("ring unbalanced")));
  std::printf("cp 2 ring with overlap / without step time = %.3f\n", t(w2.at("ring")) / t(w2.at("ring no overlap")));
  std::printf("cp 2 ring / cp 1 step time = %.3f; allgather / ring = %.3f; ulysses / ring = %.3f\n",
              t(w2.at("ring")) / t(one), t(w2.at("allgather")) / t(w2.at("ring")),
              t(w2.at("ulysses")) / t(w2.at("ring")));
  const std::map<std::string, Measured> layers = run_async_layers(seq, rounds);
  std::printf(
      "cp 2 Llama attention layer (dim 512) fwd+bwd: ring %.1f ms, async %.1f ms (%.3f); ulysses %.1f ms, "
      "async %.1f ms (%.3f)\n",
      1e3 * t(layers.at("ring")), 1e3 * t(layers.at("ring async")), t(layers.at("ring async")) / t(layers.at("ring")),
      1e3 * t(layers.at("ulysses")), 1e3 * t(layers.at("ulysses async")),
      t(layers.at("ulysses async")) / t(layers.at("ulysses")));
  return 0;
}
