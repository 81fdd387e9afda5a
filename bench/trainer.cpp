// bench/trainer: what the trainer costs over a bare training loop. One rank trains the demo model
// with hp::train::train (sampler, clipping, schedule, metrics, memory tracking) and with a plain
// LibTorch loop over the same model, batches and optimizer implementation (hp::AdamW, as the
// trainer), alternating A B in 5 rounds in one run; prints the median of the rounds' step-time
// ratios (target <= 1.05). The bare loop sums and clips in ATen's order, so the trainer runs with
// train.deterministic off there. Then the cost of train.deterministic: the trainer with and
// without it, on 1 rank and on dp_shard 2.
//
//   build/bin/bench_trainer [--quick]
#include <ATen/ATen.h>
#include <torch/types.h>  // before clip_grad.h, which uses torch::Tensor without including it
#include <unistd.h>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <algorithm>

#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>

#include "bench/timing.h"
#include "hp/data/text_data.h"
#include "hp/models/llama/spec.h"
#include "hp/nn/init.h"
#include "hp/optim/adamw.h"
#include "hp/testing/run_ranks.h"
#include "hp/train/trainer.h"
#include "hp_build_paths.h"

namespace {
namespace fs = std::filesystem;

hp::train::TrainConfig config(bool quick, const std::string& dir) {
  hp::train::TrainConfig c = hp::train::load_config(std::string(HP_SOURCE_DIR) + "/examples/tiny_llama.yaml");
  c.run_dir = dir + "/run";
  c.data.cache_dir = dir + "/data";
  c.parallel = {};
  c.train.steps = quick ? 4 : 25;
  c.schedule.warmup_steps = 1;
  c.checkpoint.interval = 0;
  c.eval.interval = 0;
  c.eval.batches = 1;
  c.sample.tokens = 0;
  return c;
}

// Seconds per step of the trainer on `world` ranks (its own mean over the steps after the first).
double trainer_step(const hp::train::TrainConfig& c, int world = 1) {
  double seconds = 0;
  hp::testing::RunRanksOptions ranks;
  ranks.group = hp::train::world_options(c, ranks.group);
  hp::testing::run_ranks(
      world,
      [&](const hp::comm::ProcessGroup& group) {
        hp::train::TrainOptions options;
        options.progress = false;
        const auto r = hp::train::train(c, group, options);
        if (group.rank() == 0) seconds = static_cast<double>(c.train.global_batch * c.data.seq_len) / r.tokens_per_s;
      },
      ranks);
  return seconds;
}

// What train.deterministic costs: step time with it over step time without, on 1 rank and on
// dp_shard 2 (ranks as threads), A B A B.
void determinism_cost(hp::train::TrainConfig c, int rounds) {
  for (int world : {1, 2}) {
    c.parallel.dp_shard = world;
    hp::train::TrainConfig fast = c;
    fast.train.deterministic = false;
    double deterministic = 0, plain = 0;
    for (int round = 0; round < rounds; ++round)
      deterministic += trainer_step(c, world), plain += trainer_step(fast, world);
    std::cout << std::fixed << std::setprecision(1) << "train.deterministic, dp_shard " << world << ": "
              << 1e3 * deterministic / rounds << " ms/step, without " << 1e3 * plain / rounds << " ms/step, ratio "
              << std::setprecision(3) << deterministic / plain << "\n";
  }
}

// Seconds per step of a bare loop: the same model, batches, micro-batching, clipping and AdamW
// implementation (hp::AdamW's foreach step, which the trainer uses).
double plain_step(const hp::train::TrainConfig& c) {
  double seconds = 0;
  hp::testing::run_ranks(1, [&](const hp::comm::ProcessGroup&) {
    const auto corpus = hp::data::prepare_corpus(c.data.sources, c.data.cache_dir, c.data.eval_fraction);
    const hp::data::TokenSampler sampler(hp::data::load_tokens(corpus.train_path), c.data.seq_len, c.seed);
    hp::models::Llama model(c.model.as<hp::models::LlamaConfig>());
    hp::nn::init_parameters(model, c.seed);
    hp::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(c.optimizer.lr)
                                                .betas({c.optimizer.beta1, c.optimizer.beta2})
                                                .eps(c.optimizer.eps)
                                                .weight_decay(c.optimizer.weight_decay));
    std::vector<double> times;
    for (int64_t step = 0; step < c.train.steps; ++step) {
      times.push_back(hp::bench::seconds([&] {
        optimizer.zero_grad();
        const int64_t micro = c.train.global_batch / c.train.micro_batch;
        for (int64_t m = 0; m < micro; ++m) {
          auto [x, y] = sampler.train_batch(step, c.train.global_batch, m * c.train.micro_batch, c.train.micro_batch);
          at::Tensor loss = at::cross_entropy_loss(model(x).flatten(0, 1), y.flatten());
          (loss / static_cast<double>(micro)).backward();
        }
        torch::nn::utils::clip_grad_norm_(model.parameters(), c.train.max_grad_norm);
        optimizer.step();
      }));
    }
    double sum = 0;  // as the trainer: the first step is warm-up
    for (size_t i = 1; i < times.size(); ++i) sum += times[i];
    seconds = sum / static_cast<double>(times.size() - 1);
  });
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const std::string dir = (fs::temp_directory_path() / ("hp_bench_trainer_" + std::to_string(::getpid()))).string();
  const hp::train::TrainConfig c = config(quick, dir);
  std::cout << "bench_trainer: demo model (" << c.model->parameter_count() << " parameters), 1 rank, "
            << c.train.global_batch << " x " << c.data.seq_len << " tokens per step, " << c.train.steps
            << " steps per run\n";
  hp::train::TrainConfig fast = c;  // as the bare loop: ATen's summation order, ATen's clipping norm
  fast.train.deterministic = false;
  double trainer = 0;
  std::vector<double> ratios;
  const int rounds = quick ? 1 : 5;
  for (int round = 0; round < rounds; ++round) {  // A B A B: drift of the machine hits both alike
    const double a = trainer_step(fast), b = plain_step(c);
    std::cout << std::fixed << std::setprecision(1) << "  round " << round + 1 << ": hp-train " << 1e3 * a
              << " ms/step, plain LibTorch loop " << 1e3 * b << " ms/step, ratio " << std::setprecision(3) << a / b
              << "\n";
    trainer += a;
    ratios.push_back(a / b);
  }
  std::cout << std::setprecision(3) << "step time hp-train / plain loop, median of " << rounds
            << " rounds = " << hp::bench::median(ratios) << " (target <= 1.05)\n"
            << std::setprecision(0)
            << "hp-train: " << static_cast<double>(c.train.global_batch * c.data.seq_len) * rounds / trainer
            << " tokens/s on one rank\n";
  determinism_cost(c, quick ? 1 : 2);
  fs::remove_all(dir);
  return 0;
}
