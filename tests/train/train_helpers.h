// For tests that train: a small deterministic corpus written to disk (no installed data needed),
// and a run of hp::train::train on ranks as threads.
#pragma once

#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "hp/models/llama/spec.h"
#include "hp/train/trainer.h"
#include "test_util.h"
#include "train/later_step_peak.h"

namespace hp::train {

// A deterministic English-like corpus, so the test needs no installed data.
inline std::string write_corpus(const std::filesystem::path& dir) {
  const char* words[] = {"the", "cat", "sat",   "on",   "a",   "mat",   "and",   "dog",  "ran",   "to",
                         "big", "red", "house", "with", "one", "small", "green", "tree", "under", "sky"};
  std::string text;
  uint64_t x = 7;
  while (text.size() < 40000) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    text += words[(x >> 33) % 20];
    text += ((x >> 20) % 9 == 0) ? ".\n" : " ";
  }
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "corpus.txt") << text;
  return (dir / "corpus.txt").string();
}

// A Llama small enough for unit tests (vocabulary 256, dim 64, 2 layers, 32-token sequences) on
// write_corpus's text, with the run and the data under `dir`; one eval batch.
inline TrainConfig small_llama_config(const std::filesystem::path& dir) {
  TrainConfig c;
  c.run_dir = (dir / "run").string();
  c.model.as<models::LlamaConfig>() = models::LlamaConfig{256, 64, 2, 4, 2, 128, 32};
  c.data.sources = {write_corpus(dir / "text")};
  c.data.cache_dir = (dir / "cache").string();
  c.data.seq_len = 32;
  c.eval.batches = 1;
  c.resilience.collective_timeout_s = 20;  // a missing peer fails a test quickly (run_ranks's default)
  return c;
}

// Ranks as threads whose world group is what train() needs for `config`.
// The watchdog of a rank that hangs fails the test instead of ending the test process, whose
// other tests would go with it; run_ranks then names the rank still running.
inline void fail_test_on_hang(TrainOptions& options) {
  options.on_hang = [](const std::string& message) { ADD_FAILURE() << message; };
}

// A stop request from the start of `step` on, for TrainOptions::stop_request: a rank given one with
// a step and the others one without see it as one process of several sees a signal; ranks all given
// the same step all stop after it.
class StopAt : public Callback {
 public:
  explicit StopAt(int64_t step) : step_(step) {}
  void on_step_begin(int64_t step) override {
    if (step == step_) signal_ = SIGTERM;
  }
  int request() const { return signal_; }

 private:
  int64_t step_;
  int signal_ = 0;
};

inline testing::RunRanksOptions ranks_for(const TrainConfig& config) {
  testing::RunRanksOptions options;
  options.group = world_options(config, options.group);
  return options;
}

// Trains `config` on `world` ranks (threads) without progress output, each rank with the callbacks
// `callbacks_of` gives it; a rank's failure is thrown (an hp::Error naming the rank).
inline void train_on_ranks(const TrainConfig& config, int world,
                           const std::function<std::vector<std::shared_ptr<Callback>>(int rank)>& callbacks_of) {
  testing::run_ranks(
      world,
      [&](const comm::ProcessGroup& group) {
        TrainOptions options;
        options.progress = false;
        fail_test_on_hang(options);
        options.callbacks = callbacks_of(group.rank());
        train(config, group, options);
      },
      ranks_for(config));
}

// The same with `callbacks` on every rank.
inline void train_on_ranks(const TrainConfig& config, int world,
                           const std::vector<std::shared_ptr<Callback>>& callbacks = {}) {
  train_on_ranks(config, world, [&](int) { return callbacks; });
}

// Trains `config` on `world` ranks as train_on_ranks does, watching each: its LaterStepPeak (its
// largest peak of the steps after the first, and the losses), by world rank.
inline std::vector<std::shared_ptr<LaterStepPeak>> train_watching_peaks(const TrainConfig& config, int world) {
  std::vector<std::shared_ptr<LaterStepPeak>> peaks(world);
  for (auto& p : peaks) p = std::make_shared<LaterStepPeak>();
  train_on_ranks(config, world, [&](int rank) { return std::vector<std::shared_ptr<Callback>>{peaks[rank]}; });
  return peaks;
}

// Trains `config` on `world` ranks (threads) without progress output; rank 0's result.
inline TrainResult rank0_result(const TrainConfig& config, int world, const testing::RunRanksOptions& ranks) {
  TrainResult result;
  std::mutex mu;
  test::run(
      world,
      [&](const comm::ProcessGroup& group) {
        TrainOptions options;
        options.progress = false;
        fail_test_on_hang(options);
        TrainResult r = train(config, group, options);
        std::lock_guard<std::mutex> lock(mu);
        if (group.rank() == 0) result = std::move(r);
      },
      ranks);
  return result;
}

inline TrainResult rank0_result(const TrainConfig& config, int world) {
  return rank0_result(config, world, ranks_for(config));
}

// Trains `c` on 2 ranks (threads), resuming if `resume`; rank 0's result. Rank `stop_rank` alone
// gets a stop request from `stop_step` on, as a signal reaches one process of several: the others
// learn of it in the step's exchange of numbers, or they would run on and the collectives would
// not match.
inline TrainResult train_two_ranks(const TrainConfig& c, bool resume, int stop_rank = -1, int64_t stop_step = 0) {
  TrainResult result;
  std::mutex mu;
  test::run(
      2,
      [&](const comm::ProcessGroup& world) {
        TrainOptions options;
        options.progress = false;
        options.resume = resume;
        fail_test_on_hang(options);
        auto stop = std::make_shared<StopAt>(world.rank() == stop_rank ? stop_step : -1);
        options.callbacks.push_back(stop);
        options.stop_request = [stop] { return stop->request(); };
        TrainResult r = train(c, world, options);
        std::lock_guard<std::mutex> lock(mu);
        if (world.rank() == 0) result = std::move(r);
      },
      ranks_for(c));
  return result;
}

// The per-step records (kind "train") of the run's metrics.jsonl, in order.
inline std::vector<nlohmann::json> train_records(const TrainConfig& c) {
  std::vector<nlohmann::json> out;
  std::ifstream in(std::filesystem::path(c.run_dir) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (auto j = nlohmann::json::parse(line); j.at("kind") == "train") out.push_back(j);
  return out;
}

// Rank 0's losses of rank0_result.
inline std::vector<double> rank0_losses(const TrainConfig& config, int world) {
  return rank0_result(config, world).losses;
}

}  // namespace hp::train
