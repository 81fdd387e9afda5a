// The watchdog: a rank without progress for its bound is ended (here: the expiry is recorded
// instead of exiting), progress keeps it quiet, and the derived bound nests above the collective
// timeout. The real exit, through hprun, is HpTrain.AHangIsEndedByATimeout.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "hp/train/trainer.h"
#include "train/watchdog.h"

namespace hp::train::detail {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

struct Expiries {
  std::promise<std::string> message;
  Watchdog::Expiry expiry() {
    return [this](const std::string& m) { message.set_value(m); };
  }
};

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

TEST(Watchdog, TheDerivedBoundNestsAboveTheCollectiveTimeout) {
  Watchdog derived(0, seconds(0), seconds(300));
  EXPECT_EQ(derived.bound(), seconds(360));
  EXPECT_EQ(derived.describe(),
            "collective 300 s (+2 s to name missing ranks) < watchdog 360 s for now (derived: the larger of the "
            "collective timeout + 60 s and 10x the slowest step)");
  Watchdog fixed(0, seconds(400), seconds(300));
  EXPECT_EQ(fixed.bound(), seconds(400));
}

}  // namespace
}  // namespace hp::train::detail
