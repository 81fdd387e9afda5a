// Last words (hp/train/stop.h): a stop request reaches every rank at the same step, which is saved,
// committed and marked before train() returns; resuming from it continues the run bitwise. The
// signals themselves, through hprun, are HpTrain.APreemptionNoticeSavesLastWordsAndTheResumeIsBitwise.
#include <gtest/gtest.h>
#include <signal.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hp/dcp/checkpoint.h"
#include "hp/train/stop.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {

// A stop request at the start of `step` that only this rank sees (as a signal reaches one process
// of several): the others learn of it in the step's exchange of numbers, or they would run on and
// the collectives would not match.
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

TrainResult run(const TrainConfig& c, bool resume, int stop_rank = -1, int64_t stop_step = 0) {
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

// Guards the agreement (rank 1 alone asks; both stop after step 3), the save (step 3 is not a
// checkpoint interval, yet it is committed, marked and the latest) and the continuation (bitwise).
TEST(LastWords, AStopRequestSavesItsStepAndTheResumeIsBitwise) {
  const std::string dir = test::scratch_dir("hp_last_words");
  TrainConfig c = small_llama_config(dir + "/straight");
  c.train.steps = 6;
  c.train.global_batch = 4;
  c.train.micro_batch = 2;
  c.checkpoint.interval = 4;
  c.parallel.dp_shard = 2;
  const std::vector<double> want = run(c, /*resume=*/false).losses;
  ASSERT_EQ(want.size(), 6u);

  c.run_dir = dir + "/stopped";
  const TrainResult stopped = run(c, /*resume=*/false, /*stop_rank=*/1, /*stop_step=*/3);
  EXPECT_EQ(stopped.stop_signal, SIGTERM);
  ASSERT_EQ(stopped.losses.size(), 3u);
  const std::optional<std::string> latest = dcp::latest_checkpoint(c.checkpoint_dir());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, c.checkpoint_dir() + "/step-000003");
  dcp::StateDict values;
  dcp::load(values, *latest);
  EXPECT_EQ(values.values.value("last_words", ""), "SIGTERM (a preemption notice)");

  const TrainResult resumed = run(c, /*resume=*/true);
  EXPECT_EQ(resumed.first_step, 3);
  EXPECT_EQ(resumed.stop_signal, 0);
  std::vector<double> got = stopped.losses;
  got.insert(got.end(), resumed.losses.begin(), resumed.losses.end());
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "step " << i + 1;
}

// Guards the process-wide request (what a signal handler makes): honoured at the first step, then
// cleared, so that a later run in the process is not stopped by it.
TEST(LastWords, TheProcesssRequestIsHonouredOnceThenCleared) {
  const std::string dir = test::scratch_dir("hp_last_words_process");
  TrainConfig c = small_llama_config(dir);
  c.train.steps = 3;
  c.train.global_batch = 2;
  c.train.micro_batch = 2;
  request_stop(SIGINT);
  const TrainResult stopped = rank0_result(c, 1);
  EXPECT_EQ(stopped.stop_signal, SIGINT);
  EXPECT_EQ(stopped.losses.size(), 1u);
  EXPECT_EQ(stop_requested(), 0);
  EXPECT_EQ(rank0_result(c, 1).losses.size(), 3u);
}

}  // namespace
}  // namespace hp::train
