// Trainer callbacks: every event, in order, with the step's record (the same numbers the run
// returns), and an exception in a callback reaches every callback's on_exception and then the
// caller.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "hp/models/llama/spec.h"
#include "hp/train/callbacks.h"
#include "hp/train/trainer.h"
#include "scratch_dir.h"
#include "test_util.h"
#include "train/train_helpers.h"

namespace hp::train {
namespace {
namespace fs = std::filesystem;

TrainConfig small_config(const std::string& name) {
  TrainConfig c = small_llama_config(test::scratch_dir("hp_callbacks_" + name));
  c.train.steps = 4;
  c.train.global_batch = 2;
  c.train.micro_batch = 2;
  c.eval.interval = 2;
  c.checkpoint.interval = 2;
  return c;
}

// Writes down what it sees.
struct Recorder : Callback {
  std::vector<std::string> events;
  std::vector<StepRecord> records;
  void on_train_begin(int64_t first_step) override { events.push_back("begin " + std::to_string(first_step)); }
  void on_step_begin(int64_t step) override { events.push_back("step " + std::to_string(step)); }
  void on_before_optimizer_step(int64_t step) override { events.push_back("optimizer " + std::to_string(step)); }
  void on_step_end(const StepRecord& r) override {
    events.push_back("end " + std::to_string(r.step) + (r.eval_loss ? " with eval" : ""));
    records.push_back(r);
  }
  void on_eval(int64_t step, double) override { events.push_back("eval " + std::to_string(step)); }
  void on_save(int64_t step, const std::string& dir) override {
    events.push_back("save " + std::to_string(step) + " " + fs::path(dir).filename().string());
  }
  void on_train_end(const TrainResult&) override { events.push_back("train end"); }
  void on_exception(int64_t step, const std::exception& e) override {
    events.push_back("exception at " + std::to_string(step) + ": " + e.what());
  }
};

struct ThrowAtStep : Callback {
  void on_step_end(const StepRecord& r) override {
    if (r.step == 2) throw Error("stop here");
  }
};

TrainResult train_with(const TrainConfig& c, const std::vector<std::shared_ptr<Callback>>& callbacks) {
  TrainResult result;
  test::run(
      1,
      [&](const comm::ProcessGroup& world) {
        TrainOptions options;
        options.progress = false;
        options.callbacks = callbacks;
        fail_test_on_hang(options);
        result = train(c, world, options);
      },
      ranks_for(c));
  return result;
}

TEST(Callbacks, SeeEveryEventInOrder) {
  auto recorder = std::make_shared<Recorder>();
  const TrainResult result = train_with(small_config("order"), {recorder});
  const std::vector<std::string> want = {
      "begin 0", "step 1",   "optimizer 1", "end 1", "step 2", "optimizer 2", "save 2 step-000002", "end 2 with eval",
      "eval 2",  "step 3",   "optimizer 3", "end 3", "step 4", "optimizer 4", "save 4 step-000004", "end 4",
      "eval 4",  "train end"};
  EXPECT_EQ(recorder->events, want);
  ASSERT_EQ(recorder->records.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(recorder->records[i].loss, result.losses[i]);
    EXPECT_EQ(recorder->records[i].grad_norm, result.grad_norms[i]);
    EXPECT_EQ(recorder->records[i].local_grad_norms.size(), 1u);
  }
}

TEST(Callbacks, AnExceptionReachesEveryCallbackThenTheCaller) {
  auto before = std::make_shared<Recorder>(), after = std::make_shared<Recorder>();
  const TrainConfig c = small_config("exception");
  test::expect_error([&] { train_on_ranks(c, 1, {before, std::make_shared<ThrowAtStep>(), after}); }, "stop here");
  EXPECT_EQ(before->events.back(), "exception at 2: stop here");
  EXPECT_EQ(after->events.back(), "exception at 2: stop here");
  // Step 2 ended (with its evaluation) for the callback before the thrower, not for the one after.
  EXPECT_NE(std::find(before->events.begin(), before->events.end(), "end 2 with eval"), before->events.end());
  EXPECT_EQ(std::find(after->events.begin(), after->events.end(), "end 2 with eval"), after->events.end());
}

}  // namespace
}  // namespace hp::train
