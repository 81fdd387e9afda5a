// bench/fsdp: fully_shard on the test Llama, measured side by side in one run.
//
//   build/bin/bench_fsdp [--quick]
//   bench/fsdp_vs_ddp      (this program under hprun against PyTorch's Python DDP)
//
// Step time (forward, backward, AdamW) of FSDP on 2 ranks (threads, one CPU thread each) with
// prefetching off and on (each block's forward gathers the next block early, its backward the
// previous one), rounds alternating, medians; and each configuration's per-rank peak memory
// next to one rank without FSDP. Ratios are printed last.
#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "bench/timing.h"
#include "hp/comm/init.h"
#include "hp/core/cpu_threads.h"
#include "hp/core/memory_tracker.h"
#include "hp/nn/init.h"
#include "hp/parallel/fsdp.h"
#include "hp/parallel/loss_parallel.h"
#include "hp/testing/run_ranks.h"
#include "tests/tp/llama_model.h"

namespace {

using hp::bench::median;
using hp::bench::seconds;
using hp::test::Llama;
using hp::test::LlamaConfig;

LlamaConfig config(bool quick) {
  LlamaConfig c;
  c.vocab = quick ? 256 : 2048;
  c.dim = quick ? 64 : 256;
  c.layers = 4;
  c.ffn_hidden = quick ? 128 : 768;
  c.max_seq = 128;
  return c;
}

struct Run {
  std::vector<double> step_seconds;
  int64_t peak = 0;
};

// Trains `steps` timed steps (after one warm-up) on this rank; world size 1 = no FSDP.
Run train(const hp::comm::ProcessGroup* world, bool quick, bool prefetch, int steps,
          hp::FullyShardOptions options = {}) {
  Run run;
  hp::MemoryTracker tracker;
  Llama model(config(quick));
  if (world) {
    hp::DeviceMesh dp = hp::init_device_mesh(*world, "cpu", {world->size()}, {"dp"});
    std::vector<hp::FSDPModule> blocks;
    for (auto& [fqn, m] : hp::nn::match_modules(model, "layers.*")) blocks.push_back(hp::fully_shard(*m, dp, options));
    for (const char* unit : {"embed", "output", ""})
      for (auto& [fqn, m] : hp::nn::match_modules(model, unit)) hp::fully_shard(*m, dp, options);
    for (size_t i = 0; prefetch && i < blocks.size(); ++i) {
      if (i + 1 < blocks.size()) blocks[i].set_modules_to_forward_prefetch({blocks[i + 1]});
      if (i > 0) blocks[i].set_modules_to_backward_prefetch({blocks[i - 1]});
    }
  }
  hp::nn::init_parameters(model, 1);
  torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-3));
  const int64_t seq = quick ? 32 : 128, batch = quick ? 2 : 4;
  const at::Tensor data =
      at::randint(0, config(quick).vocab, {batch, seq + 1}, at::make_generator<at::CPUGeneratorImpl>(3),
                  at::TensorOptions().dtype(at::kLong));
  auto step = [&] {
    optimizer.zero_grad();
    hp::cross_entropy(model(data.narrow(1, 0, seq)), data.narrow(1, 1, seq)).backward();
    optimizer.step();
  };
  step();
  for (int i = 0; i < steps; ++i) run.step_seconds.push_back(seconds(step));
  run.peak = tracker.peak();
  return run;
}

// FSDP on 2 ranks; rank 0's numbers.
Run fsdp(bool quick, bool prefetch, int steps) {
  Run mine;
  hp::testing::run_ranks(2, [&](const hp::comm::ProcessGroup& world) {
    Run r = train(&world, quick, prefetch, steps);
    if (world.rank() == 0) mine = r;
  });
  return mine;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && !std::strcmp(argv[1], "--quick");
  hp::set_cpu_threads(1);
  if (argc > 1 && !std::strcmp(argv[1], "--processes")) {  // under hprun: ranks as processes (bench/fsdp_vs_ddp)
    hp::comm::ProcessGroup world = hp::comm::init_process_group();
    hp::FullyShardOptions options;
    options.reshard_after_forward = std::getenv("HP_BENCH_RESHARD") != nullptr;
    const Run r = train(&world, /*quick=*/false, /*prefetch=*/true, /*steps=*/5, options);
    if (world.rank() == 0) std::printf("fsdp_step_ms %.2f\n", median(r.step_seconds) * 1e3);
    return 0;
  }
  const int rounds = quick ? 1 : 5, steps = quick ? 2 : 5;
  const LlamaConfig c = config(quick);
  std::printf("model: %ld layers, dim %ld, ffn %ld, vocabulary %ld; per rank batch %d x %d; fp32; 2 ranks as threads\n",
              c.layers, c.dim, c.ffn_hidden, c.vocab, quick ? 2 : 4, quick ? 32 : 128);
  std::vector<double> off, on;
  int64_t peak_off = 0, peak_on = 0;
  for (int r = 0; r < rounds; ++r) {
    const Run a = fsdp(quick, false, steps), b = fsdp(quick, true, steps);
    off.insert(off.end(), a.step_seconds.begin(), a.step_seconds.end());
    on.insert(on.end(), b.step_seconds.begin(), b.step_seconds.end());
    peak_off = a.peak, peak_on = b.peak;
  }
  const Run single = train(nullptr, quick, false, steps);
  std::printf("\n%-28s %12s %16s\n", "configuration", "step ms", "peak bytes/rank");
  std::printf("%-28s %12.2f %16ld\n", "1 rank, no FSDP", median(single.step_seconds) * 1e3, single.peak);
  std::printf("%-28s %12.2f %16ld\n", "FSDP 2 ranks, no prefetch", median(off) * 1e3, peak_off);
  std::printf("%-28s %12.2f %16ld\n", "FSDP 2 ranks, prefetch", median(on) * 1e3, peak_on);
  std::printf("ratios: step time prefetch on / off %.2f; peak memory FSDP / no FSDP %.2f\n", median(on) / median(off),
              static_cast<double>(peak_off) / single.peak);
}
