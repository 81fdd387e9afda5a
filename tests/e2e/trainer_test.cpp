// hp-train as a user runs it: hprun starts 4 processes (dp_shard 2 x tp 2) on the fortunes corpus.
#include <gtest/gtest.h>
#include <algorithm>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "e2e/e2e_util.h"
#include "hp_build_paths.h"
#include "scratch_dir.h"

namespace {
namespace fs = std::filesystem;
using hp::e2e::bin_dir;
using hp::e2e::Result;
using hp::e2e::run_command;
using hp::e2e::run_job;
using hp::e2e::train_losses;

std::string scratch(const std::string& name) { return hp::test::scratch_dir("train_e2e_" + name); }

// The demo config, shortened: 10 steps, a checkpoint every 5, data cached in `dir`.
std::string train_command(const std::string& dir, const std::string& extra = "",
                          const std::string& example = "tiny_llama.yaml") {
  return "--nproc-per-node 4 " + bin_dir() + "/hp-train --config " + HP_SOURCE_DIR + "/examples/" + example +
         " --set run_dir=" + dir + " --set data.cache_dir=" + dir + "/data --set train.steps=10" +
         " --set checkpoint.interval=5 --set schedule.warmup_steps=2 --set eval.interval=5 --set sample.tokens=16" +
         " --no-progress " + extra;
}

// The run's `latest` checkpoint is `name`, and hp-ckpt verifies the run's checkpoints.
void expect_latest_verifies(const std::string& run_dir, const std::string& name) {
  std::ifstream latest(run_dir + "/checkpoints/latest");
  std::string named;
  latest >> named;
  EXPECT_EQ(named, name);
  const Result verified = hp::e2e::run_command(bin_dir() + "/hp-ckpt verify " + run_dir + "/checkpoints");
  EXPECT_EQ(verified.exit_code, 0) << verified.output;
}

// Every tensor's chunks with their checksums: equal for two checkpoints exactly when they hold the
// same bytes (parameters and optimizer state) in the same layout.
nlohmann::json checkpoint_contents(const std::string& dir) {
  std::ifstream in(dir + "/metadata.json");
  return nlohmann::json::parse(in).at("tensors");
}

// The run's latest checkpoint through hp-ckpt convert, to Hugging Face files and back: every one of
// its `tensors` model tensors comes back bitwise, `named` among them; config.json goes out (with
// generation_config.json) and comes back as model keys of `family`.
void expect_hugging_face_round_trip_is_bitwise(const std::string& run_dir, int tensors, const std::string& named,
                                               const std::string& family) {
  const std::string ckpt = bin_dir() + "/hp-ckpt ", checkpoints = run_dir + "/checkpoints";
  const Result to_hf = hp::e2e::run_command(ckpt + "convert --to hf " + checkpoints + " " + run_dir + "/hf");
  ASSERT_EQ(to_hf.exit_code, 0) << to_hf.output;
  EXPECT_TRUE(fs::exists(run_dir + "/hf/model.safetensors"));
  EXPECT_TRUE(fs::exists(run_dir + "/hf/config.json")) << to_hf.output;
  std::ifstream generation(run_dir + "/hf/generation_config.json");
  ASSERT_TRUE(generation.good()) << to_hf.output;
  const auto generation_config = nlohmann::json::parse(generation);
  EXPECT_EQ(generation_config.at("do_sample"), false);
  EXPECT_GT(generation_config.at("max_length").get<int64_t>(), 0);
  const Result back = hp::e2e::run_command(ckpt + "convert --from hf " + run_dir + "/hf " + run_dir + "/back");
  ASSERT_EQ(back.exit_code, 0) << back.output;
  std::ifstream keys(run_dir + "/back/model.yaml");
  const std::string model_keys((std::istreambuf_iterator<char>(keys)), std::istreambuf_iterator<char>());
  EXPECT_NE(model_keys.find("family: " + family + "\n"), std::string::npos) << model_keys;
  const Result inspected = hp::e2e::run_command(ckpt + "inspect " + run_dir + "/back");
  EXPECT_NE(inspected.output.find(named), std::string::npos) << inspected.output;
  // One chunk per tensor on both sides, so equal checksums mean equal bytes.
  ASSERT_EQ(hp::e2e::run_command(ckpt + "consolidate " + checkpoints + " " + run_dir + "/whole").exit_code, 0);
  const auto original = checkpoint_contents(run_dir + "/whole"), round_trip = checkpoint_contents(run_dir + "/back");
  int compared = 0;
  for (const auto& [name, record] : round_trip.items()) {
    ASSERT_EQ(record.at("chunks").size(), 1u) << name;
    EXPECT_EQ(record.at("chunks")[0].at("checksums"), original.at(name).at("chunks")[0].at("checksums")) << name;
    ++compared;
  }
  EXPECT_EQ(compared, tensors);
}

// The demo in reduced form: trains, evaluates, checkpoints, plots, samples.
TEST(HpTrain, DemoRunsInReducedForm) {
  const std::string dir = scratch("demo");
  const Result r = run_job(train_command(dir));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("final eval loss"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sample:"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/loss.svg"));
  EXPECT_TRUE(fs::exists(dir + "/checkpoints/step-000010/metadata.json"));
  const auto losses = train_losses(dir);
  ASSERT_EQ(losses.size(), 10u);
  EXPECT_LT(losses.at(10), losses.at(1) - 1.0) << "the loss should fall clearly in 10 steps";

  // The checkpoint through hp-ckpt: verify, export to Hugging Face and back, inspect.
  const Result verified = hp::e2e::run_command(bin_dir() + "/hp-ckpt verify " + dir + "/checkpoints");
  EXPECT_EQ(verified.exit_code, 0) << verified.output;
  EXPECT_NE(verified.output.find("every checksum matches"), std::string::npos) << verified.output;
  expect_hugging_face_round_trip_is_bitwise(dir, 39, "model.layers.3.attn.q_proj.weight", "llama");  // 4 x 9 + 3

  // A bf16 export (what published models ship): about half the bytes, config.json says bfloat16,
  // and --dtype fp32 brings it back as fp32 tensors.
  const std::string ckpt = bin_dir() + "/hp-ckpt ";
  const Result to_bf16 =
      hp::e2e::run_command(ckpt + "convert --to hf --dtype bf16 " + dir + "/checkpoints " + dir + "/hf16");
  ASSERT_EQ(to_bf16.exit_code, 0) << to_bf16.output;
  const auto fp32_bytes = fs::file_size(dir + "/hf/model.safetensors"),
             bf16_bytes = fs::file_size(dir + "/hf16/model.safetensors");
  EXPECT_LT(bf16_bytes, fp32_bytes / 2 + 8192) << "bf16 export";
  std::ifstream config(dir + "/hf16/config.json");
  const std::string config_text((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  EXPECT_NE(config_text.find("\"torch_dtype\": \"bfloat16\""), std::string::npos) << config_text;
  const Result back = hp::e2e::run_command(ckpt + "convert --from hf --dtype fp32 " + dir + "/hf16 " + dir + "/back16");
  ASSERT_EQ(back.exit_code, 0) << back.output;
  const Result inspected = hp::e2e::run_command(ckpt + "inspect " + dir + "/back16");
  EXPECT_NE(inspected.output.find("Float"), std::string::npos) << inspected.output;
  EXPECT_EQ(inspected.output.find("BFloat16"), std::string::npos) << inspected.output;
  EXPECT_EQ(hp::e2e::run_command(ckpt + "convert --to hf --dtype int8 " + dir + "/checkpoints " + dir + "/x").exit_code,
            2);
}

// SIGKILL one rank after the step-5 checkpoint, rerun with --resume auto: the remaining losses and
// the final parameters and optimizer state are bitwise those of an uninterrupted run.
void kill_and_resume(const std::string& name, const std::string& parallel,
                     const std::string& example = "tiny_llama.yaml", std::string* straight_run = nullptr) {
  const std::string straight = scratch(name + "_straight"), killed = scratch(name + "_killed");
  if (straight_run) *straight_run = straight;
  ASSERT_EQ(run_job(train_command(straight, parallel, example)).exit_code, 0);

  const Result crash =
      hp::e2e::run_command("HP_FAULT=kill:1:7 " + bin_dir() + "/hprun " + train_command(killed, parallel, example));
  ASSERT_NE(crash.exit_code, 0) << crash.output;
  EXPECT_NE(crash.output.find("rank 1"), std::string::npos) << crash.output;
  ASSERT_TRUE(fs::exists(killed + "/checkpoints/step-000005/metadata.json")) << crash.output;
  EXPECT_FALSE(fs::exists(killed + "/checkpoints/step-000010"));

  const Result resumed = run_job(train_command(killed, parallel + " --resume auto", example));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto want = train_losses(straight), got = train_losses(killed);
  ASSERT_EQ(got.size(), 10u);
  for (int64_t step = 1; step <= 10; ++step) EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;
  EXPECT_EQ(checkpoint_contents(killed + "/checkpoints/step-000010"),
            checkpoint_contents(straight + "/checkpoints/step-000010"));
}

TEST(HpTrain, KillAndResumeIsBitwiseIdentical) { kill_and_resume("fsdp_tp", ""); }

// The same in fp32 (the main job trains in bf16).
TEST(HpTrain, KillAndResumeInFp32IsBitwiseIdentical) { kill_and_resume("fsdp_tp_fp32", "--set train.dtype=fp32"); }

// The same with async TP (sequence parallel, TP's gathers and reduce-scatters fused with its matmuls
// through the symmetric memory the processes map).
TEST(HpTrain, KillAndResumeWithAsyncTensorParallelismIsBitwiseIdentical) {
  kill_and_resume("async_tp", "--set parallel.sequence_parallel=true --set parallel.async_tp=true");
}

// The same through a pipeline: pp 2 (1F1B) x dp_shard 2, each rank checkpointing its own stage.
TEST(HpTrain, KillAndResumeThroughAPipelineIsBitwiseIdentical) {
  kill_and_resume("pp", "--set parallel.pp=2 --set parallel.tp=1");
}

// Tied embeddings across the pipeline: the last stage's copy is saved by the first stage only and
// loaded into both.
TEST(HpTrain, KillAndResumeWithTiedEmbeddingsAcrossStagesIsBitwiseIdentical) {
  kill_and_resume("pp_tied", "--set parallel.pp=2 --set parallel.tp=1 --set model.tie_embeddings=true");
}

// Residual and attention dropout: the masks are functions of (seed, step, global position), so
// the resumed steps draw what the uninterrupted run drew.
TEST(HpTrain, KillAndResumeWithDropoutIsBitwiseIdentical) {
  kill_and_resume("dropout", "--set model.residual_dropout=0.1 --set model.attention_dropout=0.1");
}

// Muon for the hidden matrices and AdamW for the rest, as one ChainedOptimizer: both halves' state
// resumes bitwise (momentum buffers; moments and step counts).
TEST(HpTrain, KillAndResumeWithMuonIsBitwiseIdentical) { kill_and_resume("muon", "--set optimizer.name=muon"); }

// The Qwen3-MoE example (dp_shard 4 with ep 2 borrowed from it): each rank's experts and their
// optimizer state resume bitwise from their expert-sharded checkpoint chunks. Its checkpoint goes
// to Hugging Face files (each expert apart) and back bitwise.
TEST(HpTrain, KillAndResumeWithExpertParallelismIsBitwiseIdentical) {
  std::string straight;
  kill_and_resume("qwen3_moe_ep", "--set train.global_batch=8 --set train.micro_batch=2", "tiny_qwen3_moe.yaml",
                  &straight);
  if (HasFatalFailure()) return;
  // 4 layers x (4 attention weights, 2 QK norms, 2 norms, the router's gate and bias, 3 stacked
  // expert weights) + embed, norm, output.
  expect_hugging_face_round_trip_is_bitwise(straight, 4 * 13 + 3, "model.layers.3.mlp.experts.w2", "qwen3_moe");
}

// The same example through a pipeline (pp 2 x dp_shard 2, ep 2): the second stage's routers' expert
// biases (buffers that only its ranks hold) are saved by its lowest rank and resume bitwise.
TEST(HpTrain, KillAndResumeWithExpertParallelismThroughAPipelineIsBitwiseIdentical) {
  kill_and_resume("qwen3_moe_ep_pp",
                  "--set parallel.pp=2 --set parallel.dp_shard=2 --set train.global_batch=8 --set train.micro_batch=2",
                  "tiny_qwen3_moe.yaml");
}

// The long-context example (cp 4, ring attention over the head-tail cut), on 256-token sequences:
// every rank's parameters and optimizer state (FSDP over dp_shard x cp) resume bitwise.
TEST(HpTrain, KillAndResumeWithContextParallelismIsBitwiseIdentical) {
  kill_and_resume("cp", "--set data.seq_len=256 --set sample.tokens=0", "long_context_llama.yaml");
}

// The same with cp 2 under HSDP (dp_replicate 2): FSDP shards over dp_shard x cp, replicas over
// dp_replicate. These runs also sample (greedy generation under cp).
TEST(HpTrain, KillAndResumeWithContextParallelismUnderHsdpIsBitwiseIdentical) {
  kill_and_resume("cp_hsdp",
                  "--set data.seq_len=256 --set sample.tokens=8 --set parallel.cp=2 --set parallel.dp_replicate=2 "
                  "--set train.micro_batch=2",
                  "long_context_llama.yaml");
}

// hprun --max-restarts 1, rank 2 SIGKILLed after step 7 by the fault injector: hprun starts every
// rank again, hp-train resumes from the step-5 checkpoint, the fault does not fire a second time,
// and the losses and the final checkpoint are bitwise those of an uninterrupted run. hprun's summary
// names the rank and the two steps (6 and 7) the failure cost.
TEST(HpTrain, RestartAfterAKilledRankIsBitwiseIdentical) {
  const std::string straight = scratch("restart_straight"), restarted = scratch("restart_killed");
  ASSERT_EQ(run_job(train_command(straight)).exit_code, 0);
  const Result r =
      hp::e2e::run_command("HP_FAULT=kill:2:7 " + bin_dir() + "/hprun --max-restarts 1 " + train_command(restarted));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hprun: rank 2 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restart 1 of this job: resuming from its latest checkpoint"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 9 (Killed)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("after step 7; attempt 2 resumed from step 5: 2 steps lost"), std::string::npos) << r.output;
  const auto want = train_losses(straight), got = train_losses(restarted);
  ASSERT_EQ(got.size(), 10u);
  for (int64_t step = 1; step <= 10; ++step) EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;
  EXPECT_EQ(checkpoint_contents(restarted + "/checkpoints/step-000010"),
            checkpoint_contents(straight + "/checkpoints/step-000010"));
}

// hprun --max-restarts 1, rank 2 raising an error after step 7's backward: every rank saves step 6,
// which they all hold, as last words; the other ranks exit with code 4 and hprun names rank 2 (exit
// code 1) although the ranks exit together; the restart resumes from step 6 (no step lost) and the
// losses and the final checkpoint are bitwise those of an uninterrupted run.
TEST(HpTrain, RestartAfterAnErrorInOneRankLosesNoStep) {
  const std::string straight = scratch("error_straight"), restarted = scratch("error_restarted");
  ASSERT_EQ(run_job(train_command(straight)).exit_code, 0);
  const Result r = hp::e2e::run_command("HP_FAULT=throw:2:7:backward " + bin_dir() + "/hprun --max-restarts 1 " +
                                        train_command(restarted));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("hprun: rank 2 (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("exited with code 1; stopping the other ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("training ended because of an error on another rank (world rank 2, in step 7: injected "
                          "fault: rank 2 failed after step 7's backward)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("Step 6, which every rank held, is saved in " + restarted + "/checkpoints/step-000006"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("attempt 2 resumed from step 6: 0 steps lost"), std::string::npos) << r.output;
  const auto want = train_losses(straight), got = train_losses(restarted);
  ASSERT_EQ(got.size(), 10u);
  for (int64_t step = 1; step <= 10; ++step) EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;
  EXPECT_EQ(checkpoint_contents(restarted + "/checkpoints/step-000010"),
            checkpoint_contents(straight + "/checkpoints/step-000010"));
}

// hprun --recover-processes, rank 1 SIGKILLed after step 9 with an in-memory checkpoint every 4
// steps and none on disk: hprun starts only rank 1's process again; ranks 0, 2 and 3 go on in the
// processes hprun started them as and meet it in a new world; rank 1 takes step 8 back from the copy
// rank 2 keeps, which rank 2 damages the first time it sends it (the checksum shows it, and rank 1
// asks again). One step is lost, and the losses are bitwise those of an uninterrupted run.
TEST(HpTrain, ProcessLevelRecoveryRestartsOnlyTheDeadRank) {
  const std::string straight = scratch("recover_straight"), recovered = scratch("recover_killed");
  const std::string in_memory =
      "--set train.steps=12 --set checkpoint.interval=0 --set resilience.in_memory_checkpoint_interval=4";
  ASSERT_EQ(run_job(train_command(straight, in_memory)).exit_code, 0);
  const Result r =
      hp::e2e::run_command("HP_FAULT=kill:1:9,damage_copy:2:8 " + bin_dir() +
                           "/hprun --max-restarts 1 --recover-processes " + train_command(recovered, in_memory));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<int, std::string> pids;  // as hprun started them
  const std::regex started("rank (\\d+) pid (\\d+)");
  const size_t line = r.output.find("hprun: the ranks' processes: ");
  ASSERT_NE(line, std::string::npos) << r.output;
  const std::string listed = r.output.substr(line, r.output.find('\n', line) - line);
  for (std::sregex_iterator it(listed.begin(), listed.end(), started), end; it != end; ++it)
    pids[std::stoi((*it)[1])] = (*it)[2];
  ASSERT_EQ(pids.size(), 4u) << listed;
  EXPECT_NE(r.output.find("hprun: rank 1 (pid " + pids[1] +
                          ") was killed by signal 9 (Killed); starting only its "
                          "process again (recovery 1, restart 1 of at most 1)"),
            std::string::npos)
      << r.output;
  for (int rank : {0, 2, 3})
    EXPECT_NE(r.output.find("recovery 1: world rank " + std::to_string(rank) + " goes on in its process (pid " +
                            pids[rank] + ")"),
              std::string::npos)
        << "rank " << rank << ":\n"
        << r.output;
  EXPECT_NE(r.output.find("the copy of step 8 from world rank 2 arrived damaged (its checksum differs); asking for "
                          "it again"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("took back step 8 from the copy that world rank 2, its buddy, kept"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("after step 9; only its process was started again (pid"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("continuing from step 8 in memory: 1 step lost"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(recovered + "/checkpoints")) << "nothing was to be read from disk";
  const auto want = train_losses(straight), got = train_losses(recovered);
  ASSERT_EQ(got.size(), 12u);
  for (int64_t step = 1; step <= 12; ++step) EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;
}

// A preemption notice at step 7 (HP_FAULT has rank 0 send SIGTERM to hprun, which forwards it to
// every rank): the ranks agree to stop after step 7, save it as last words and exit; the checkpoint
// verifies and is marked, and --resume auto continues from it bitwise (losses and the final
// checkpoint equal an uninterrupted run's). Guards that the stop is agreed at the step the notice
// came in (with no last words, step 5 would be resumed) and that the save is complete.
TEST(HpTrain, APreemptionNoticeSavesLastWordsAndTheResumeIsBitwise) {
  const std::string straight = scratch("preempt_straight"), preempted = scratch("preempted");
  ASSERT_EQ(run_job(train_command(straight)).exit_code, 0);
  const Result r = hp::e2e::run_command("HP_FAULT=preempt:0:7 " + bin_dir() + "/hprun " + train_command(preempted));
  EXPECT_EQ(r.exit_code, 130) << r.output;
  EXPECT_NE(r.output.find("stopped after step 7 of 10 on SIGTERM (a preemption notice): last words in"),
            std::string::npos)
      << r.output;
  expect_latest_verifies(preempted, "step-000007");
  std::ifstream metadata(preempted + "/checkpoints/step-000007/metadata.json");
  const nlohmann::json values = nlohmann::json::parse(metadata).at("values");
  EXPECT_EQ(values.value("last_words", ""), "SIGTERM (a preemption notice)") << values.dump();
  const Result resumed = run_job(train_command(preempted, "--resume auto"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + preempted + "/checkpoints/step-000007 at step 7"), std::string::npos)
      << resumed.output;
  const auto want = train_losses(straight), got = train_losses(preempted);
  ASSERT_EQ(got.size(), 10u);
  for (int64_t step = 1; step <= 10; ++step) EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;
  EXPECT_EQ(checkpoint_contents(preempted + "/checkpoints/step-000010"),
            checkpoint_contents(straight + "/checkpoints/step-000010"));
}

// The timeouts nest: a rank that hangs (HP_FAULT) is reported by its peer's collective timeout,
// naming it; when every rank hangs no collective fails, and the watchdog ends them (exit code 3).
TEST(HpTrain, AHangIsEndedByATimeout) {
  const std::string two_ranks =
      "--nproc-per-node 2 " + bin_dir() + "/hp-train --config " + HP_SOURCE_DIR +
      "/examples/tiny_llama.yaml --set parallel.tp=1 --set train.steps=6 --set schedule.warmup_steps=2 --no-progress" +
      " --set resilience.collective_timeout_s=2 --set resilience.watchdog_s=8";
  const std::string dir = scratch("hang");
  const std::string where = " --set run_dir=" + dir + " --set data.cache_dir=" + dir + "/data";
  const Result one = hp::e2e::run_command("HP_FAULT=hang:1:3 " + bin_dir() + "/hprun " + two_ranks + where);
  EXPECT_EQ(one.exit_code, 1) << one.output;  // a failed run, not a config error
  EXPECT_NE(one.output.find("timeouts: collective 2 s (+2 s to name missing ranks) < watchdog 8 s"), std::string::npos)
      << one.output;
  EXPECT_NE(one.output.find("never reached it (dead, or stuck elsewhere): [1]"), std::string::npos) << one.output;
  const Result all = hp::e2e::run_command("HP_FAULT=hang:0:3,hang:1:3 " + bin_dir() + "/hprun " + two_ranks + where);
  EXPECT_EQ(all.exit_code, 3) << all.output;
  EXPECT_NE(all.output.find("made no progress for 8 s (in step 3); ending the process with exit code 3"),
            std::string::npos)
      << all.output;
}

// SIGKILL a rank while the step-10 checkpoint is being written (right after save_async returned):
// nothing of it is committed, and the step-5 checkpoint stays the latest and verifies.
TEST(HpTrain, KillDuringAsyncSaveKeepsThePreviousCheckpoint) {
  const std::string dir = scratch("killsave");
  const Result crash =
      hp::e2e::run_command("HP_FAULT=kill:1:10 " + bin_dir() + "/hprun " + train_command(dir, "--set train.steps=12"));
  ASSERT_NE(crash.exit_code, 0) << crash.output;
  EXPECT_FALSE(fs::exists(dir + "/checkpoints/step-000010"));
  expect_latest_verifies(dir, "step-000005");
  const Result resumed = run_job(train_command(dir, "--set train.steps=12 --resume auto"));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(fs::exists(dir + "/checkpoints/step-000010/metadata.json"));
}

// train.deterministic (the default) through hprun, real processes: at the main job's global batch
// (16) and a fixed micro-batch (4), every step's loss and the final checkpoint (parameters and
// optimizer state, consolidated to one chunk per tensor and compared by checksum) are the same bits
// for dp_shard 1, 2 and 4; dp_replicate 2 x dp_shard 2 against dp_shard 4; and, at tp 2, dp_shard
// 1 against 2. train.cpu_threads=1 gives every rank the same intra-op threads whatever hprun's
// split of the cores. In bf16 (the main job's dtype) and in fp32.
TEST(HpTrain, DataParallelDegreeDoesNotChangeOneBit) {
  struct Layout {
    std::string name;
    int ranks;
    std::string dims;
  };
  const std::vector<std::vector<Layout>> groups = {
      {{"dp1", 1, "dp_shard=1 --set parallel.tp=1"},
       {"dp2", 2, "dp_shard=2 --set parallel.tp=1"},
       {"dp4", 4, "dp_shard=4 --set parallel.tp=1"},
       {"hsdp", 4, "dp_shard=2 --set parallel.dp_replicate=2 --set parallel.tp=1"}},
      {{"tp2", 2, "dp_shard=1 --set parallel.tp=2"}, {"tp2dp2", 4, "dp_shard=2 --set parallel.tp=2"}}};
  const std::string ckpt = bin_dir() + "/hp-ckpt ";
  for (const std::string dtype : {"bf16", "fp32"})
    for (const auto& group : groups) {
      std::map<int64_t, double> want_losses;
      nlohmann::json want_state;
      for (const Layout& layout : group) {
        const std::string dir = scratch("deterministic_" + dtype + "_" + layout.name);
        const Result r = run_job(
            "--nproc-per-node " + std::to_string(layout.ranks) + " " + bin_dir() + "/hp-train --config " +
            HP_SOURCE_DIR + "/examples/tiny_llama.yaml --set run_dir=" + dir + " --set data.cache_dir=" + dir +
            "/data --set train.steps=3 --set schedule.warmup_steps=1" +
            " --set train.micro_batch=4 --set train.cpu_threads=1 --set checkpoint.interval=3 --set eval.batches=1" +
            " --set sample.tokens=0 --no-progress --set train.dtype=" + dtype + " --set parallel." + layout.dims);
        ASSERT_EQ(r.exit_code, 0) << dtype << " " << layout.name << "\n" << r.output;
        ASSERT_EQ(hp::e2e::run_command(ckpt + "consolidate " + dir + "/checkpoints " + dir + "/whole").exit_code, 0);
        const auto losses = train_losses(dir);
        const nlohmann::json state = checkpoint_contents(dir + "/whole");
        ASSERT_EQ(losses.size(), 3u) << layout.name;
        if (want_losses.empty()) {
          want_losses = losses, want_state = state;
          EXPECT_GT(state.size(), 39u) << "parameters and optimizer state";
          continue;
        }
        for (const auto& [step, loss] : want_losses)
          EXPECT_EQ(losses.at(step), loss)
              << dtype << " " << layout.name << " vs " << group.front().name << ", step " << step;
        EXPECT_EQ(state, want_state) << dtype << " " << layout.name << " vs " << group.front().name;
      }
    }
}

// --dry-run prints the plan of every rank, with each rank's dry-run peak, and trains nothing.
TEST(HpTrain, DryRunPrintsThePlan) {
  const std::string dir = scratch("dry");
  const Result r = run_job(train_command(dir, "--dry-run"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("plan: dp_replicate=1 dp_shard=2 tp=2 pp=1 on 4 ranks"), std::string::npos) << r.output;
  // Each rank's quarter of the parameters (tp 2 x dp_shard 2), and its dry run's peak.
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(r.output.find("rank " + std::to_string(rank) + ": 820352 parameter elements (3.28 MB), dry-run peak "),
              std::string::npos)
        << r.output;
  EXPECT_FALSE(fs::exists(dir + "/metrics.jsonl"));
  // Against a memory limit per rank: the ranks' peaks are about 62 MB.
  const Result small = run_job(train_command(dir, "--dry-run --memory-limit 0.01 --report-dir " + dir + "/report"));
  ASSERT_EQ(small.exit_code, 0) << small.output;
  // Each rank's report: the table, the JSON with the peak by category, the step's allocations.
  for (int rank = 0; rank < 4; ++rank) {
    const std::string base = dir + "/report/rank_" + std::to_string(rank);
    std::ifstream table(base + ".txt"), json(base + ".json"), csv(base + "_lifetimes.csv");
    const std::string text{std::istreambuf_iterator<char>(table), {}};
    EXPECT_NE(text.find("largest at the peak:"), std::string::npos) << text;
    const nlohmann::json report = nlohmann::json::parse(json);
    EXPECT_EQ(report.at("rank"), rank);
    int64_t sum = 0;
    for (const auto& [category, bytes] : report.at("peak_by_category").items()) sum += bytes.get<int64_t>();
    EXPECT_GT(sum, 0);
    std::string header;
    std::getline(csv, header);
    EXPECT_EQ(header, "id,bytes,category,block,allocated_at,freed_at");
  }
  EXPECT_EQ(run_job(train_command(dir, "--report-dir " + dir + "/report")).exit_code, 2);
  EXPECT_NE(small.output.find("against 0.01 GiB per rank"), std::string::npos) << small.output;
  EXPECT_NE(small.output.find("dry-run peak"), std::string::npos) << small.output;
  EXPECT_NE(small.output.find("4 of 4 ranks do not fit in 0.01 GiB"), std::string::npos) << small.output;
  const Result large = run_job(train_command(dir, "--dry-run --memory-limit 1 --allocator-slack 0.5"));
  ASSERT_EQ(large.exit_code, 0) << large.output;
  EXPECT_NE(large.output.find("50% allocator slack against 1 GiB per rank"), std::string::npos) << large.output;
  EXPECT_NE(large.output.find("all ranks fit in 1 GiB"), std::string::npos) << large.output;
  const Result refused = run_job(train_command(dir, "--memory-limit 1"));
  EXPECT_EQ(refused.exit_code, 2) << refused.output;
  EXPECT_NE(refused.output.find("--memory-limit answers a --dry-run"), std::string::npos) << refused.output;
}

// --dry-run of a mixture of experts: its routers choose by the routing model --routing names. A
// skewed one makes the ranks holding the hot expert (one of each expert-parallel pair) the larger.
TEST(HpTrain, DryRunOfAMixtureOfExpertsTakesARoutingModel) {
  const std::string dir = scratch("dry_moe");
  const Result r = run_job(train_command(dir, "--dry-run --routing skewed:0.5", "tiny_qwen3_moe.yaml"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("its routers choosing by a skewed:0.5 routing model"), std::string::npos) << r.output;
  std::vector<double> peaks;
  for (int rank = 0; rank < 4; ++rank) {
    const std::string line = "rank " + std::to_string(rank) + ": ";
    const size_t at = r.output.find(line);
    ASSERT_NE(at, std::string::npos) << r.output;
    const size_t peak = r.output.find("dry-run peak ", at);
    ASSERT_NE(peak, std::string::npos) << r.output;
    peaks.push_back(std::stod(r.output.substr(peak + 13)));
  }
  std::vector<double> sorted = peaks;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted[0], sorted[1]) << r.output;
  EXPECT_EQ(sorted[2], sorted[3]) << r.output;
  EXPECT_LT(sorted[1], sorted[2]) << r.output;
  const Result bad = run_job(train_command(dir, "--dry-run --routing skewed:2", "tiny_qwen3_moe.yaml"));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--routing: routing model: skewed needs a hot share in (0, 1), got 2"), std::string::npos)
      << bad.output;
  // A capacity the hot expert's rows overflow stops the dry run as it would stop the run: 4 sequences
  // of 128 tokens choose 2 of 8 experts, a capacity of 128 rows each, and expert 0 gets all 512.
  const Result overflow = run_job(
      train_command(dir, "--dry-run --routing skewed:0.5 --set model.capacity_factor=1", "tiny_qwen3_moe.yaml"));
  EXPECT_EQ(overflow.exit_code, 1) << overflow.output;
  EXPECT_NE(overflow.output.find("expert 0 got 512 rows, over its capacity of 128"), std::string::npos)
      << overflow.output;
  const Result alone = run_job(train_command(dir, "--routing balanced", "tiny_qwen3_moe.yaml"));
  EXPECT_EQ(alone.exit_code, 2) << alone.output;
  EXPECT_NE(alone.output.find("--routing goes with --dry-run"), std::string::npos) << alone.output;
}

// A config mistake stops every rank with the documented message before any work.
TEST(HpTrain, ConfigErrorStopsBeforeWork) {
  const std::string dir = scratch("bad");
  const Result r = run_job(train_command(dir, "--set parallel.tp=4"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("parallel dims dp_replicate=1 dp_shard=2 tp=4 pp=1 multiply to 8 but the world has 4 ranks"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir + "/metrics.jsonl"));
  // hprun --recover-processes starts a dead rank's process alone: it needs its buddy's copy.
  const Result no_memory = run_job("--max-restarts 1 --recover-processes " + train_command(dir));
  EXPECT_EQ(no_memory.exit_code, 2) << no_memory.output;
  EXPECT_NE(
      no_memory.output.find("hprun --recover-processes starts a dead rank's process again alone, which then "
                            "takes its state from a buddy's memory: set resilience.in_memory_checkpoint_interval"),
      std::string::npos)
      << no_memory.output;
  EXPECT_NE(no_memory.output.find("not restarting: exit code 2"), std::string::npos) << no_memory.output;
}

// A step whose gradients are not finite stops every rank with exit code 1, naming the step and
// where, and leaves the previous step's checkpoint committed.
TEST(HpTrain, ANonFiniteStepFailsWithExitCode1) {
  const std::string dir = scratch("nonfinite");
  const Result r = run_job("--nproc-per-node 2 " + bin_dir() + "/hp-train --config " + HP_SOURCE_DIR +
                           "/examples/tiny_llama.yaml --set run_dir=" + dir + " --set data.cache_dir=" + dir +
                           "/data --set parallel.tp=1 --set optimizer.lr=1e30 --set train.max_grad_norm=0" +
                           " --set schedule.warmup_steps=0 --set train.steps=4 --set checkpoint.interval=1" +
                           " --set checkpoint.keep=4 --no-progress");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("hp-train: failed: step 2: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("embed.weight on rank 0"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/checkpoints/step-000001/metadata.json")) << r.output;
  EXPECT_FALSE(fs::exists(dir + "/checkpoints/step-000002")) << r.output;
}

// hp-train timing a layout for hprun --cpu-layout auto (HP_LAYOUT_PROBE set): it trains the
// config's first 8 steps and stops, writes its tokens/s, and leaves nothing in the run directory
// (no metrics, no checkpoint, though the config saves every 5 steps). A dry run, or a run with no
// step after the first to time, answers "skip".
TEST(HpTrain, TimingALayoutLeavesTheRunAlone) {
  const std::string dir = scratch("layout_probe"), answer = dir + "/answer";
  const std::string probe = "env HP_LAYOUT_PROBE=" + answer + " " + bin_dir() + "/hprun ";
  const std::string run_dir = dir + "/run", data = " --set data.cache_dir=" + dir + "/data";
  const Result r = run_command(probe + train_command(run_dir, data));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("stopped after step 8 of 10"), std::string::npos) << r.output;
  std::ifstream in(answer);
  double tokens_per_s = 0.0;
  EXPECT_TRUE(in >> tokens_per_s);
  EXPECT_GT(tokens_per_s, 0.0);
  EXPECT_FALSE(fs::exists(run_dir)) << r.output;
  for (const std::string extra : {"--dry-run", "--set train.steps=1 --set schedule.warmup_steps=0"}) {
    fs::remove(answer);
    const Result skip = run_command(probe + train_command(run_dir, extra + data));
    EXPECT_EQ(skip.exit_code, 0) << skip.output;
    std::ifstream said(answer);
    std::string word;
    EXPECT_TRUE(said >> word) << extra;
    EXPECT_EQ(word, "skip") << extra;
    EXPECT_FALSE(fs::exists(run_dir)) << extra;
  }
}

// hprun --cpu-layout auto with hp-train: one candidate (the environment fixes the capability and
// the threads) keeps it short; the job then runs as configured.
TEST(HpTrain, CpuLayoutAutoTimesTheJobThenRunsIt) {
  const std::string dir = scratch("cpu_layout");
  const Result r = run_command("env HOME=" + dir + " ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 " + bin_dir() +
                               "/hprun --cpu-layout auto " + train_command(dir));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("timing 1 layouts of 4 ranks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1 thread per rank, avx2: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1 thread per rank, avx2, the fastest"), std::string::npos) << r.output;
  EXPECT_EQ(train_losses(dir).size(), 10u);
  EXPECT_TRUE(fs::exists(dir + "/checkpoints/step-000010/metadata.json")) << r.output;
}

}  // namespace
