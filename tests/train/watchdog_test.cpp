// The watchdog: a rank without progress for its bound is ended (here: the expiry is recorded
// instead of exiting), progress keeps it quiet, and the derived bound nests above the collective
// timeout. The real exit, through hprun, is HpTrain.AHangIsEndedByATimeout.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "train/train_helpers.h"
#include "train/watchdog.h"

namespace hp::train::detail {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// Each of the two final phases takes more than the test's 4 s watchdog bound for the small Llama
// (about 5 and 6 s on a 2-core AMD EPYC; with either progress report removed, the test fails).
constexpr int64_t kFinalEvalBatches = 3000;
constexpr int64_t kSampledTokens = 3500;

struct Expiries {
  std::promise<std::string> message;
  Watchdog::Expiry expiry() {
    return [this](const std::string& m) { message.set_value(m); };
  }
};

// Guards the expiry: no progress for the bound ends the rank, not earlier, naming where it was.
TEST(Watchdog, EndsARankThatMakesNoProgress) {
  Expiries seen;
  Watchdog watchdog(3, seconds(1), milliseconds(100), seen.expiry());
  const auto start = std::chrono::steady_clock::now();
  watchdog.on_train_begin(4);
  watchdog.on_step_begin(5);
  auto message = seen.message.get_future();
  ASSERT_EQ(message.wait_for(seconds(5)), std::future_status::ready);
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(1000));
  EXPECT_EQ(message.get().rfind("watchdog: rank 3 made no progress for 1 s (in step 5); ending the process", 0), 0u);
}

// Guards against false alarms: steps shorter than the bound, and a stopped watchdog, say nothing.
TEST(Watchdog, ProgressKeepsItQuiet) {
  Expiries seen;
  auto message = seen.message.get_future();
  {
    Watchdog watchdog(0, seconds(1), milliseconds(100), seen.expiry());
    watchdog.on_train_begin(0);
    for (int step = 1; step <= 8; ++step) {
      watchdog.on_step_begin(step);
      std::this_thread::sleep_for(milliseconds(150));
      StepRecord record;
      record.step = step;
      watchdog.on_step_end(record);
      std::this_thread::sleep_for(milliseconds(150));
    }
    watchdog.on_train_end(TrainResult{});
    std::this_thread::sleep_for(milliseconds(1500));  // stopped: its bound passes without a word
  }
  EXPECT_EQ(message.wait_for(milliseconds(0)), std::future_status::timeout);
}

// Guards the order of the timeouts: a derived bound starts 60 s above the collective timeout.
TEST(Watchdog, TheDerivedBoundNestsAboveTheCollectiveTimeout) {
  Watchdog derived(0, seconds(0), seconds(300));
  EXPECT_EQ(derived.bound(), seconds(360));
  EXPECT_EQ(derived.describe(),
            "collective 300 s (+2 s to name missing ranks) < watchdog 360 s for now (derived: the larger of the "
            "collective timeout + 60 s and 10x the slowest step)");
  Watchdog fixed(0, seconds(400), seconds(300));
  EXPECT_EQ(fixed.bound(), seconds(400));
}

// Guards the derived bound's second term: it follows the slowest step (10x) once that exceeds the
// collective timeout's margin.
TEST(Watchdog, TheDerivedBoundGrowsWithTheSlowestStep) {
  Expiries seen;  // a stalled machine must fail the test, not end the test process
  Watchdog watchdog(0, seconds(0), milliseconds(100), seen.expiry(), /*margin=*/seconds(1));
  EXPECT_EQ(watchdog.bound(), milliseconds(1100));
  watchdog.on_train_begin(0);
  watchdog.on_step_begin(1);
  std::this_thread::sleep_for(milliseconds(300));
  StepRecord record;
  record.step = 1;
  watchdog.on_step_end(record);
  EXPECT_GE(watchdog.bound(), milliseconds(3000));
  EXPECT_LT(watchdog.bound(), milliseconds(20000));  // 10x a step that overslept by up to 1.7 s
  watchdog.on_step_begin(2);                         // a faster step leaves it where it is
  std::this_thread::sleep_for(milliseconds(10));
  record.step = 2;
  const milliseconds before = watchdog.bound();
  watchdog.on_step_end(record);
  EXPECT_EQ(watchdog.bound(), before);
  watchdog.on_train_end(TrainResult{});
}

// Seconds from the end of the last step to the end of training: the final phases.
double final_phases_seconds(const TrainConfig& c) {
  struct Clock : Callback {
    std::chrono::steady_clock::time_point last_step, end;
    void on_step_end(const StepRecord&) override { last_step = std::chrono::steady_clock::now(); }
    void on_train_end(const TrainResult&) override { end = std::chrono::steady_clock::now(); }
  };
  auto clock = std::make_shared<Clock>();
  train_on_ranks(c, 1, {clock});  // a rank the watchdog ends fails the test (fail_test_on_hang)
  return std::chrono::duration<double>(clock->end - clock->last_step).count();
}

// Guards the trainer's progress reports after the last step: the final evaluation, and the
// sample, each longer than a short watchdog bound (4 s), are progress batch by batch and token by
// token. A phase faster than the bound on this machine proves nothing: the test says so and skips.
TEST(Watchdog, TheFinalEvaluationAndSamplingAreProgress) {
  TrainConfig c = small_llama_config(test::scratch_dir("hp_watchdog_final"));
  c.train.steps = 1;
  c.train.global_batch = 2;
  c.train.micro_batch = 2;
  c.resilience.collective_timeout_s = 1;
  c.resilience.watchdog_s = 4;
  c.eval.batches = kFinalEvalBatches;
  const double evaluating = final_phases_seconds(c);
  c.eval.batches = 1;
  c.sample.tokens = kSampledTokens;
  const double sampling = final_phases_seconds(c);
  if (evaluating < 4.5 || sampling < 4.5)
    GTEST_SKIP() << "the final evaluation took " << evaluating << " s and the sample " << sampling
                 << " s: both must outlast the 4 s bound for this test to show anything";
}

}  // namespace
}  // namespace hp::train::detail
