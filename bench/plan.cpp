// bench/plan: how close the dry run (hp::train::dry_run) comes to what training measures, and what
// it costs. For layouts of examples/tiny_llama.yaml on up to 4 ranks (threads of this process):
// each rank's measured step peak (the trainer's peak_mem_bytes, the largest of steps 2 to 5)
// against its dry-run peak, and the seconds one rank's dry run takes. With --scale: one rank of a
// 256-rank job of a 70B-class Llama and of Qwen3-235B-A22B, each in two layouts, each one's
// seconds and this process's peak resident memory after it (the peak so far: each layout's
// includes those before it).
//
//   build/bin/bench_plan [--quick] [--scale]
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "hp/testing/run_ranks.h"
#include "hp/train/dry_run.h"
#include "hp/train/trainer.h"
#include "hp_build_paths.h"
#include "train/later_step_peak.h"

namespace {

std::vector<double> measured_peaks(const hp::train::TrainConfig& c, int world) {
  std::vector<std::shared_ptr<hp::train::LaterStepPeak>> peaks(world);
  for (auto& p : peaks) p = std::make_shared<hp::train::LaterStepPeak>();
  hp::testing::RunRanksOptions ranks;
  ranks.group = hp::train::world_options(c, ranks.group);
  hp::testing::run_ranks(
      world,
      [&](const hp::comm::ProcessGroup& group) {
        hp::train::TrainOptions options;
        options.progress = false;
        options.callbacks = {peaks[group.rank()]};
        hp::train::train(c, group, options);
      },
      ranks);
  std::vector<double> out;
  for (const auto& p : peaks) out.push_back(p->bytes);
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Layout {
  const char* name;
  std::vector<std::string> overrides;
};

void calibration(bool quick, const std::string& dir) {
  const std::vector<Layout> layouts = {
      {"one rank", {"parallel.dp_shard=1", "parallel.tp=1"}},
      {"tp 2, sp", {"parallel.dp_shard=1", "parallel.tp=2", "parallel.sequence_parallel=true"}},
      {"dp_shard 2", {"parallel.dp_shard=2", "parallel.tp=1"}},
      {"dp_shard 2 x tp 2, sp", {"parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"}},
      {"dp_replicate 2", {"parallel.dp_shard=1", "parallel.tp=1", "parallel.dp_replicate=2"}},
      {"cp 2", {"parallel.dp_shard=1", "parallel.tp=1", "parallel.cp=2"}},
      {"pp 2, 1f1b", {"parallel.dp_shard=1", "parallel.tp=1", "parallel.pp=2"}},
      {"pp 2 x tp 2, zbv (unit costs)",
       {"parallel.dp_shard=1", "parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_costs=unit",
        "model.layers=4"}},
      {"dp_shard 2, checkpointing", {"parallel.dp_shard=2", "parallel.tp=1", "memory.checkpoint=full"}},
  };
  std::cout << "layout                          rank   predicted MB   measured MB    error   dry run s\n";
  for (const Layout& layout : layouts) {
    std::vector<std::string> overrides = layout.overrides;
    for (const std::string& o :
         {"train.steps=5", "schedule.warmup_steps=1", "eval.interval=0", "checkpoint.interval=0", "sample.tokens=0"})
      overrides.push_back(o);
    overrides.push_back("run_dir=" + dir + "/run");
    overrides.push_back("data.cache_dir=" + dir + "/data");
    const hp::train::TrainConfig c =
        hp::train::load_config(std::string(HP_SOURCE_DIR) + "/examples/tiny_llama.yaml", overrides);
    const int world = static_cast<int>(c.parallel.world_size());
    const std::vector<double> measured = measured_peaks(c, world);
    for (int rank = 0; rank < world; ++rank) {
      const auto start = std::chrono::steady_clock::now();
      const hp::train::DryRunReport predicted = hp::train::dry_run(c, world, rank);
      const double took = seconds_since(start);
      std::cout << std::left << std::setw(32) << layout.name << std::right << std::setw(4) << rank << std::fixed
                << std::setprecision(2) << std::setw(15) << static_cast<double>(predicted.peak_bytes) / 1e6
                << std::setw(14) << measured[rank] / 1e6 << std::setw(8) << std::setprecision(1)
                << 100.0 * (static_cast<double>(predicted.peak_bytes) / measured[rank] - 1.0) << "%" << std::setw(12)
                << std::setprecision(2) << took << "\n";
    }
    if (quick) break;
  }
}

int64_t peak_resident_mb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) / 1024;
  return -1;
}

// Rank 0 of a 256-rank job of `model` (its YAML but the parallel dims) in each of `layouts`
// (name, YAML of the parallel dims): the seconds its dry run takes, its peak, and this process's
// peak resident memory so far.
void time_rank0(const std::string& name, const std::string& model,
                const std::vector<std::pair<std::string, std::string>>& layouts) {
  for (const auto& [layout, parallel] : layouts) {
    const hp::train::TrainConfig c = hp::train::parse_config(model + parallel, {});
    const auto start = std::chrono::steady_clock::now();
    const hp::train::DryRunReport report = hp::train::dry_run(c, 256, 0);
    std::cout << name << ", rank 0 of 256, " << layout << ": " << std::fixed << std::setprecision(1)
              << seconds_since(start) << " s, step peak " << static_cast<double>(report.peak_bytes) / (1 << 30)
              << " GiB; this process's peak resident memory so far " << peak_resident_mb() << " MB\n";
  }
}

void scale() {
  time_rank0("70B-class Llama",
             "model: {family: llama, vocab: 128256, dim: 8192, layers: 80, heads: 64, kv_heads: 8, ffn_hidden: 28672, "
             "max_seq: 8192}\n"
             "data: {seq_len: 8192}\n"
             "train: {global_batch: 32, micro_batch: 1, dtype: bf16, steps: 10}\n"
             "schedule: {warmup_steps: 1}\n"
             "memory: {checkpoint: full}\n",
             {{"dp_shard 32 x tp 8, sp", "parallel: {dp_shard: 32, tp: 8, sequence_parallel: true}\n"},
              {"pp 8 x dp_shard 4 x tp 8, sp, 1f1b",
               "parallel: {pp: 8, dp_shard: 4, tp: 8, sequence_parallel: true, pp_schedule: 1f1b}\n"}});
  // The shape of hp::models::qwen3_235b_a22b(); its routers choose by the balanced routing model.
  time_rank0("Qwen3-235B-A22B",
             "model: {family: qwen3_moe, vocab: 151936, dim: 4096, layers: 94, heads: 64, kv_heads: 4, head_dim: 128, "
             "max_seq: 40960, experts: 128, top_k: 8, expert_hidden: 1536}\n"
             "data: {seq_len: 4096}\n"
             "train: {global_batch: 64, micro_batch: 1, dtype: bf16, steps: 10}\n"
             "schedule: {warmup_steps: 1}\n"
             "memory: {checkpoint: full}\n",
             {{"dp_replicate 2 x dp_shard 32 x tp 4, sp, ep 32",
               "parallel: {dp_replicate: 2, dp_shard: 32, tp: 4, sequence_parallel: true, ep: 32}\n"},
              {"pp 2 x dp_shard 32 x tp 4, sp, ep 32, 1f1b",
               "parallel: {pp: 2, dp_shard: 32, tp: 4, sequence_parallel: true, ep: 32, pp_schedule: 1f1b}\n"}});
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, at_scale = false;
  for (int i = 1; i < argc; ++i) {
    quick = quick || std::strcmp(argv[i], "--quick") == 0;
    at_scale = at_scale || std::strcmp(argv[i], "--scale") == 0;
  }
  if (at_scale) {
    scale();
    return 0;
  }
  const std::string dir = "/tmp/hp_bench_plan";
  calibration(quick, dir);
  return 0;
}
