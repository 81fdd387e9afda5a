// The cost model (hp/train/cost_model.h) and hp-plan's search (hp/train/auto_parallel.h): a dry
// run records the work a real step does; a step's estimate is the sum of its calibrated lines (a
// pipeline's, its simulated schedule); a calibration reads back what it wrote and refuses what it
// did not; the search covers every layout the config allows and ranks them as it says.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "hp/comm/init.h"
#include "hp/core/dispatch_mode.h"
#include "hp/core/kernel_observer.h"
#include "hp/pp/schedule.h"
#include "hp/testing/run_ranks.h"
#include "hp/train/auto_parallel.h"
#include "hp/train/cost_model.h"
#include "hp/train/dry_run.h"
#include "scratch_dir.h"
#include "train/layout_step.h"
#include "train/least_squares.h"
#include "train/work_recorder.h"
#include "train_helpers.h"

namespace hp::train {
namespace {

TrainConfig small(const std::string& name) {
  TrainConfig c = small_llama_config(test::scratch_dir(name));
  c.train.global_batch = 8;
  c.train.micro_batch = 2;
  c.eval.interval = 0;
  return c;
}

// The work of rank `rank`'s second step of `c` on `world` (rank `rank` of it), recorded around a
// real step on the CPU.
StepWork real_step_work(const TrainConfig& c, const comm::ProcessGroup& world) {
  detail::LayoutStep step(c, world);
  step.run(c.per_rank_batch());  // the first step makes the optimizer's state
  StepWork work;
  detail::WorkRecorder recorder(&work, /*timed=*/false);
  {
    const DispatchModeGuard on(recorder);
    const KernelObserverGuard kernels(&recorder);
    step.run(c.per_rank_batch(), &recorder);
  }
  return work;
}

bool exact_class(const std::string& cost_class) {
  return cost_class.rfind("matmul", 0) == 0 || cost_class.rfind("kernel", 0) == 0;
}

// Matrix products and hp's kernels, size by size, and collectives: exactly. The other ops in all,
// within `calls` of their count and 15% of their work: the host's work on metadata differs (a dry
// run makes attention's masks on meta from their shapes), and an in-place collective's result is
// copied back into its tensor after the wait on a real group (15 such copies in tp 2's clipping and
// optimizer step), where a fake one returns the tensor.
void expect_same_work(const PhaseWork& dry, const PhaseWork& real, const std::string& what, double calls = 0.1) {
  std::set<std::pair<std::string, int>> keys;
  for (const auto& [key, w] : dry.ops) keys.insert(key);
  for (const auto& [key, w] : real.ops) keys.insert(key);
  double dry_calls = 0, real_calls = 0, dry_work = 0, real_work = 0;
  for (const auto& key : keys) {
    const auto d = dry.ops.find(key), r = real.ops.find(key);
    const OpWork none;
    const OpWork& dw = d == dry.ops.end() ? none : d->second;
    const OpWork& rw = r == real.ops.end() ? none : r->second;
    if (exact_class(key.first)) {
      EXPECT_EQ(dw.calls, rw.calls) << what << ": " << key.first << " of size 2^" << key.second;
      EXPECT_EQ(dw.work, rw.work) << what << ": " << key.first << " of size 2^" << key.second;
    } else {
      dry_calls += static_cast<double>(dw.calls);
      real_calls += static_cast<double>(rw.calls);
      dry_work += dw.work;
      real_work += rw.work;
    }
  }
  EXPECT_NEAR(dry_calls, real_calls, calls * real_calls) << what << ": ops other than matrix products and kernels";
  EXPECT_NEAR(dry_work, real_work, 0.15 * real_work) << what << ": their work";
  ASSERT_EQ(dry.collectives.size(), real.collectives.size()) << what;
  for (const auto& [key, w] : real.collectives) {
    ASSERT_TRUE(dry.collectives.count(key)) << what << ": " << key.first << " on " << key.second << " ranks";
    EXPECT_EQ(dry.collectives.at(key).calls, w.calls) << what << ": " << key.first;
    EXPECT_EQ(dry.collectives.at(key).bytes, w.bytes) << what << ": " << key.first;
  }
}

// What the dry run records (on meta tensors, in a fake world) is what the real step does, phase by
// phase: its matrix products and kernels size by size and its collectives exactly, its other ops
// nearly (expect_same_work). One rank, and rank 0 of tp 2 with sequence parallelism and of dp_shard 2.
TEST(CostModel, ADryRunRecordsTheWorkOfTheRealStep) {
  const TrainConfig one = small("cost_work_one");
  const StepWork dry_one = dry_run(one, 1, 0).work;
  const StepWork real_one = real_step_work(one, comm::fake_world(1, 0, world_options(one)));
  ASSERT_TRUE(std::any_of(real_one.forward.ops.begin(), real_one.forward.ops.end(),
                          [](const auto& op) { return op.first.first == "matmul Float"; }));
  expect_same_work(dry_one.forward, real_one.forward, "one rank, forward");
  expect_same_work(dry_one.backward, real_one.backward, "one rank, backward");
  expect_same_work(dry_one.optimizer, real_one.optimizer, "one rank, optimizer");
  for (const auto& [name, dims] :
       {std::pair<const char*, std::pair<int64_t, int64_t>>{"tp 2", {1, 2}}, {"dp_shard 2", {2, 1}}}) {
    TrainConfig c = small("cost_work_sharded");
    c.parallel.dp_shard = dims.first;
    c.parallel.tp = dims.second;
    c.sequence_parallel = dims.second > 1;
    const StepWork dry = dry_run(c, 2, 0).work;
    StepWork real;
    testing::run_ranks(
        2,
        [&](const comm::ProcessGroup& world) {
          StepWork mine = real_step_work(c, world);
          if (world.rank() == 0) real = mine;
        },
        ranks_for(c));
    EXPECT_FALSE(real.backward.collectives.empty()) << name;
    expect_same_work(dry.forward, real.forward, std::string(name) + ", forward");
    expect_same_work(dry.backward, real.backward, std::string(name) + ", backward");
    expect_same_work(dry.optimizer, real.optimizer, std::string(name) + ", optimizer", /*calls=*/2.0);
  }
}

// The fit a calibration makes: exact coefficients back from exact data; one the data want negative
// held at 0 and the others refitted; two columns that say the same do not make coefficients up; a
// column required positive.
TEST(CostModel, NonnegativeLeastSquaresFindsTheCoefficients) {
  const std::vector<std::vector<double>> X = {{1, 2, 0.5}, {2, 1, 1}, {3, 5, 2}, {4, 3, 0}, {1, 1, 1}};
  const auto times = [&](const std::vector<double>& c) {
    std::vector<double> y;
    for (const auto& row : X) y.push_back(row[0] * c[0] + row[1] * c[1] + row[2] * c[2]);
    return y;
  };
  const std::vector<double> exact = detail::nonnegative_least_squares(X, times({0.5, 2e-6, 3e3}));
  EXPECT_NEAR(exact[0], 0.5, 1e-9);
  EXPECT_NEAR(exact[1], 2e-6, 1e-12);
  EXPECT_NEAR(exact[2], 3e3, 1e-6);
  const std::vector<double> held = detail::nonnegative_least_squares(X, times({1, -1, 0.25}));
  EXPECT_EQ(held[1], 0.0);
  EXPECT_GE(held[0], 0.0);
  EXPECT_GE(held[2], 0.0);
  const std::vector<double> same = detail::nonnegative_least_squares({{1, 1}, {2, 2}, {3, 3}}, {2, 4, 6});
  EXPECT_NEAR(same[0] + same[1], 2.0, 1e-9);
  EXPECT_GE(same[0], 0.0);
  EXPECT_GE(same[1], 0.0);
  // A column that must be positive: kept in every fit, and no fit when the data want it below 0.
  EXPECT_NEAR(detail::nonnegative_least_squares(X, times({0.5, 0, 0}), /*positive=*/1u)[0], 0.5, 1e-9);
  EXPECT_TRUE(detail::nonnegative_least_squares({{1.0}, {2.0}}, {-1.0, -2.0}, /*positive=*/1u).empty());
}

// A calibration whose every number is known.
Calibration known_calibration() {
  Calibration cal;
  cal.ranks = 2;
  cal.cores = 2;                                     // no contention: the threads fit the cores
  cal.compute["matmul Float"][10] = {1024.0, 2e-3};  // 2 ms per 1024 FLOPs at size 2^10
  cal.compute["matmul Float"][12] = {4096.0, 4e-3};
  cal.compute["elementwise"][8] = {256.0, 1e-4};
  cal.compute_scale = 1.5;
  cal.between_ops = 1e-5;
  cal.collective_wait = 2e-4;
  cal.step_overhead = 3e-3;
  for (const char* name : {"all_reduce", "send", "recv"}) cal.collectives[name][2] = {1e-4, 1e-9};
  cal.collectives["all_reduce"][4] = {5e-4, 4e-9};
  return cal;
}

// The fused ops of async TP move what their collective moves: priced on its line (their matmuls are
// compute, recorded as such).
TEST(CostModel, FusedOpsArePricedAsTheirCollectives) {
  Calibration cal = known_calibration();
  cal.collectives["all_gather"][2] = {2e-4, 3e-9};
  cal.collectives["reduce_scatter"][2] = {3e-4, 5e-9};
  const CollectiveWork work{3, 1e6};
  EXPECT_EQ(cal.collective_seconds("all_gather_matmul", 2, work), cal.collective_seconds("all_gather", 2, work));
  EXPECT_EQ(cal.collective_seconds("matmul_reduce_scatter", 2, work),
            cal.collective_seconds("reduce_scatter", 2, work));
  EXPECT_NE(cal.collective_seconds("all_gather", 2, work), cal.collective_seconds("reduce_scatter", 2, work));
}

// Work of a class the calibration has no timing for (a kernel newer than the calibration) is
// priced at the time per op only, and the estimate names it; work-free classes (views) are not
// named.
TEST(CostModel, AnEstimateNamesTheWorkItCouldNotPrice) {
  Calibration cal = known_calibration();
  StepWork w;
  w.forward.ops[{"matmul Float", 12}] = {1, 4096.0};
  w.backward.ops[{"kernel cross_entropy_backward", 20}] = {2, 1e6};
  w.backward.ops[{"view", -1}] = {10, 0.0};
  const StepTimeEstimate unpriced = estimate_step_time(TrainConfig{}, {w}, cal);
  EXPECT_EQ(unpriced.unpriced, std::set<std::string>{"kernel cross_entropy_backward"});
  EXPECT_EQ(unpriced_warning(unpriced.unpriced),
            "the calibration has no timing for kernel cross_entropy_backward, so the estimates price that work at the "
            "time per op only; calibrate again with this build");
  cal.compute["kernel cross_entropy_backward"][20] = {1e6, 1e-3};
  const StepTimeEstimate priced = estimate_step_time(TrainConfig{}, {w}, cal);
  EXPECT_TRUE(priced.unpriced.empty());
  EXPECT_EQ(unpriced_warning(priced.unpriced), "");
  EXPECT_NEAR(priced.seconds - unpriced.seconds, 1.5 * 2 * 5e-4, 1e-12);  // 2 calls of 5e5 work at 1e-3 per 1e6
}

// A step's estimate is its lines added up: each op its size's time in proportion to its work (an
// unprofiled size the nearest one's, no quicker than the class's quickest call), scaled; the time
// between ops; each collective its nearest group size's latency and bytes, and the wait; the
// trainer's time per step.
TEST(CostModel, AStepsTimeIsTheSumOfItsLines) {
  const Calibration cal = known_calibration();
  StepWork w;
  w.forward.ops[{"matmul Float", 10}] = {3, 3 * 2048.0};  // twice the profiled work per call
  w.forward.ops[{"elementwise", 9}] = {2, 2 * 64.0};      // size 9 unprofiled: no quicker than 1e-4
  w.backward.ops[{"matmul Float", 11}] = {1, 3000.0};     // nearest size: 12 (the larger of two as near)
  w.backward.ops[{"view", -1}] = {10, 0.0};               // a class the profile did not see
  w.backward.collectives[{"all_reduce", 3}] = {2, 1e6};   // nearest group size: 4
  w.optimizer.collectives[{"all_reduce", 2}] = {1, 1e3};
  const double forward = 1.5 * (3 * 2e-3 * 2 + 2 * 1e-4) + 1e-5 * 5;
  const double backward = 1.5 * (4e-3 * 3000.0 / 4096.0) + 1e-5 * 11 + (2 * 5e-4 + 4e-9 * 1e6) + 2 * 2e-4;
  const double optimizer = 1e-4 + 1e-9 * 1e3 + 2e-4;
  const StepTimeEstimate e = estimate_step_time(TrainConfig{}, {w}, cal);
  EXPECT_NEAR(e.seconds, forward + backward + optimizer + 3e-3, 1e-12);
  EXPECT_NEAR(e.communication, (2 * 5e-4 + 4e-9 * 1e6) + 2 * 2e-4 + optimizer, 1e-12);
  EXPECT_EQ(e.bubble, 0.0);
  // A collective the calibration has no line for is an error naming it.
  w.forward.collectives[{"all_to_all", 2}] = {1, 8.0};
  EXPECT_THROW(
      {
        try {
          estimate_step_time(TrainConfig{}, {w}, cal);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("no line for collective all_to_all"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
}

// A pipeline's step is its schedule simulated with each position's F and B per micro-batch (its
// forward and backward over the micro-batches, sends aside) and a send's cost, plus the slowest
// optimizer, scaled for the cores its idle ranks leave to the busy ones, plus the trainer's time.
TEST(CostModel, APipelinesStepIsItsSimulatedSchedule) {
  const Calibration cal = known_calibration();
  TrainConfig c;
  c.parallel.pp = 2;
  c.train.global_batch = 8;
  c.train.micro_batch = 2;  // 4 micro-batches
  c.pp_schedule = "1f1b";
  std::vector<StepWork> positions(2);
  positions[0].forward.ops[{"matmul Float", 10}] = {4, 4 * 1024.0};   // F: 1.5 x 2 ms
  positions[0].backward.ops[{"matmul Float", 10}] = {8, 8 * 1024.0};  // B: 1.5 x 4 ms
  positions[0].forward.collectives[{"send", 2}] = {4, 4 * 1e5};       // one activation: 1e5 bytes
  positions[1].forward.ops[{"matmul Float", 10}] = {8, 8 * 1024.0};
  positions[1].backward.ops[{"matmul Float", 10}] = {16, 16 * 1024.0};
  positions[1].optimizer.ops[{"elementwise", 8}] = {1, 256.0};
  const double ms = 1e-3, op = 1e-5;
  pp::ActionCosts costs;
  costs.send = 1e-4 + 1e-9 * 1e5;
  costs.by_stage = {{3 * ms + op, (6 * ms + 2 * op) / 2, (6 * ms + 2 * op) / 2},
                    {6 * ms + 2 * op, (12 * ms + 4 * op) / 2, (12 * ms + 4 * op) / 2}};
  const pp::Simulation sim = pp::simulate(pp::one_f_one_b(2, 4), costs);
  const StepTimeEstimate e = estimate_step_time(c, positions, cal);
  EXPECT_NEAR(e.seconds, sim.makespan + 1.5 * 1e-4 + op + 3e-3, 1e-12);
  EXPECT_NEAR(e.bubble, sim.bubble, 1e-12);
  // The 2 ranks measured sharing 1 core: the pipeline's busy ranks, 2 (1 - bubble) on average,
  // share it less.
  Calibration shared = cal;
  shared.cores = 1;
  EXPECT_NEAR(shared.contention(2.0), 1.0, 1e-15);
  EXPECT_NEAR(shared.contention(1.0), 0.5, 1e-15);
  EXPECT_NEAR(shared.contention(0.5), 0.5, 1e-15);  // one busy rank has the core to itself at most
  EXPECT_NEAR(estimate_step_time(c, positions, shared).seconds,
              (sim.makespan + 1.5 * 1e-4 + op) * shared.contention(2 * (1 - sim.bubble)) + 3e-3, 1e-12);
  EXPECT_THROW(estimate_step_time(c, {positions[0]}, cal), Error);  // one position's work for pp 2
}

// A calibration reads back what it wrote; a file that is not one is refused with what is wrong.
TEST(CostModel, ACalibrationReadsBackWhatItWroteAndNamesWhatIsWrong) {
  Calibration cal = known_calibration();
  cal.profile.push_back({"one rank, 2 rows", 0.25, 0.24});
  const Calibration back = Calibration::from_json(cal.json());
  EXPECT_EQ(back.json(), cal.json());
  EXPECT_EQ(back.compute.at("matmul Float").at(12).seconds, 4e-3);
  EXPECT_EQ(back.collectives.at("all_reduce").at(4).per_byte, 4e-9);
  const auto refused = [](const std::string& text, const std::string& reason) {
    try {
      Calibration::from_json(text);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  };
  refused("not json", "calibration: not JSON");
  refused("{}", "calibration: no 'ranks'");
  std::string text = cal.json();
  refused(text.replace(text.find("\"12\""), 4, "\"x\""), "'x' is not a whole number");
  text = cal.json();
  refused(text.replace(text.find("0.004"), 5, "-0.04"), "must be two finite numbers >= 0");
  text = cal.json();
  refused(text.replace(text.find("\"compute_scale\": 1.5"), 20, "\"compute_scale\": 0"), "compute_scale > 0");
}

// Calibrating on 2 ranks (threads): every rank gets the same calibration, with lines for the
// model's op classes and every collective on groups of 2, and the profile's steps (one rank at each
// size, and the trained tp 2 and dp_shard 2) with what the calibration gives for them.
TEST(CostModel, CalibratingGivesEveryRankTheSameLines) {
  TrainConfig c = small("cost_calibrate");
  CalibrateOptions options;
  options.rows = {1, 2};
  options.warmup_steps = 0;
  options.profiled_steps = 1;
  options.collective_bytes = {1 << 10, 64 << 10};
  options.collective_repeats = 2;
  std::vector<std::string> json(2);
  testing::run_ranks(
      2, [&](const comm::ProcessGroup& world) { json[world.rank()] = calibrate(c, world, options).json(); },
      ranks_for(c));
  EXPECT_EQ(json[0], json[1]);
  const Calibration cal = Calibration::from_json(json[0]);
  EXPECT_EQ(cal.ranks, 2);
  EXPECT_TRUE(cal.compute.count("matmul Float")) << json[0];
  EXPECT_TRUE(cal.compute.count("elementwise")) << json[0];
  for (const char* name : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier", "send"})
    EXPECT_TRUE(cal.collectives.count(name) && cal.collectives.at(name).count(2)) << name;
  ASSERT_EQ(cal.profile.size(), 4u) << json[0];
  EXPECT_EQ(cal.profile[0].layout, "one rank, 1 rows");
  EXPECT_EQ(cal.profile[3].layout, "dp_shard 2, micro_batch 2 (trained)");
  for (const auto& p : cal.profile) {
    EXPECT_GT(p.seconds, 0.0) << p.layout;
    EXPECT_GT(p.predicted, 0.0) << p.layout;
  }
}

// The search tries every layout of the world (dp_replicate x dp_shard x tp x pp x cp, schedules,
// micro-batches, checkpointing) the config allows, dry-runs it, and ranks those that fit by their
// estimate, then the others by peak; its configs are what the overrides say.
TEST(AutoParallel, RanksEveryLayoutTheConfigAllows) {
  TrainConfig c = small("plan_search");
  PlanOptions options;
  options.world_size = 2;
  options.micro_batch_choices = 2;
  // 2 ranks: 5 placements of the factor 2, each with 2 micro-batches and 2 checkpointing choices;
  // ep 1 or 2 where dp_shard x tp x cp is 2 (a dense model refuses ep 2 when validated), two
  // schedules with pp 2: (1 + 2 + 2 + 2 + 2) x 2 x 2.
  EXPECT_EQ(candidate_layouts(c, options).size(), 36u);
  // V-Half and V-Min are tried where they hold less than ZBV (pp 4: 3 and 2 of 1F1B's 4 stages,
  // given enough micro-batches), not at pp 2, where they hold what ZBV holds and idle more.
  PlanOptions four = options;
  four.world_size = 4;
  four.micro_batch_choices = 8;
  std::map<std::string, std::set<std::string>> pp_of;  // schedule -> the parallel.pp overrides tried
  for (const std::vector<std::string>& overrides : candidate_layouts(c, four)) {
    std::string pp, schedule;
    for (const std::string& o : overrides) {
      if (o.rfind("parallel.pp=", 0) == 0) pp = o;
      if (o.rfind("parallel.pp_schedule=", 0) == 0) schedule = o.substr(o.find('=') + 1);
    }
    if (pp != "parallel.pp=1") pp_of[schedule].insert(pp);
  }
  const std::set<std::string> both = {"parallel.pp=2", "parallel.pp=4"}, four_only = {"parallel.pp=4"};
  EXPECT_EQ(pp_of["1f1b"], both);
  EXPECT_EQ(pp_of["zbv"], both);
  EXPECT_EQ(pp_of["vhalf"], four_only);
  EXPECT_EQ(pp_of["vmin"], four_only);
  // At pp 3 V-Min holds what V-Half holds (2 of 1F1B's 3 stages) and idles no less: not tried.
  PlanOptions three = four;
  three.world_size = 3;
  std::set<std::string> at_three;
  for (const std::vector<std::string>& overrides : candidate_layouts(c, three))
    if (std::count(overrides.begin(), overrides.end(), "parallel.pp=3"))
      for (const std::string& o : overrides)
        if (o.rfind("parallel.pp_schedule=", 0) == 0) at_three.insert(o.substr(o.find('=') + 1));
  EXPECT_EQ(at_three, (std::set<std::string>{"1f1b", "zbv", "vhalf"}));
  // Only schedules that place the stages alike prune each other: interleaved (2 stages per rank,
  // not in a V) stays beside ZBV, which beats it at equal costs but refuses tied embeddings.
  PlanOptions mixed = options;
  mixed.schedules = {"zbv", "interleaved"};
  size_t interleaved = 0;
  for (const std::vector<std::string>& overrides : candidate_layouts(c, mixed))
    interleaved += std::count(overrides.begin(), overrides.end(), "parallel.pp_schedule=interleaved");
  EXPECT_GT(interleaved, 0u);
  // Settings of reductions a layout does not have are reset in that layout, so that it is tried
  // rather than refused: a tensor-parallel wire where tp is 1, a data-parallel one where dp is 1.
  TrainConfig wired = c;
  wired.comm_settings.tp_wire = "bf16";
  wired.comm_settings.gradient_wire = "fp8_e4m3";
  wired.train.mixed_precision_reduce = "bf16";
  const std::vector<std::vector<std::string>> wired_layouts = candidate_layouts(wired, options);
  ASSERT_EQ(wired_layouts.size(), 36u);
  for (const std::vector<std::string>& overrides : wired_layouts) {
    const TrainConfig laid = parse_config(to_json(wired), overrides);
    try {
      validate(laid, 2);
    } catch (const Error& e) {  // for other reasons (a dense model's ep 2, layers per stage), not the wires
      EXPECT_EQ(std::string(e.what()).find("wire"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("mixed_precision_reduce"), std::string::npos) << e.what();
    }
    EXPECT_EQ(laid.comm_settings.tp_wire, laid.parallel.tp > 1 ? "bf16" : "native");
    EXPECT_EQ(laid.comm_settings.gradient_wire, laid.parallel.dp() * laid.parallel.cp > 1 ? "fp8_e4m3" : "native");
    EXPECT_EQ(laid.train.mixed_precision_reduce, laid.parallel.dp() * laid.parallel.cp > 1 ? "bf16" : "fp32");
  }
  // Checkpointing is the search's: hp-train's choice per block is refused, not silently dropped.
  TrainConfig budget = c;
  budget.memory.budget_mb = 100;
  test::expect_error([&] { candidate_layouts(budget, options); },
                     "hp-plan: it searches memory.checkpoint itself; leave memory.blocks and memory.budget_mb");
  Calibration cal = known_calibration();
  cal.compute.clear();
  cal.compute["matmul Float"][20] = {1 << 20, 1e-3};
  for (const char* name : {"all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier"})
    cal.collectives[name][2] = {1e-4, 1e-9};
  std::vector<PlannedLayout> all = plan_layouts(c, cal, options);
  ASSERT_GE(all.size(), 16u);  // cp 2 of 32-token rows and the rest: whatever validate allows
  for (size_t i = 1; i < all.size(); ++i) EXPECT_LE(all[i - 1].estimate.seconds, all[i].estimate.seconds);
  std::set<std::string> layouts;
  for (const PlannedLayout& l : all) {
    EXPECT_EQ(l.config.parallel.world_size(), 2);
    EXPECT_TRUE(layouts.insert(l.describe()).second) << l.describe();
    const nlohmann::json keys = nlohmann::json::parse(to_json(l.config));  // every key's value
    for (const std::string& o : l.overrides) {
      const std::string key = o.substr(0, o.find('=')), value = o.substr(o.find('=') + 1);
      const std::string got = keys.at(key).is_string() ? keys.at(key).get<std::string>() : keys.at(key).dump();
      EXPECT_EQ(got, value) << l.describe() << ": " << key;
    }
  }
  // A pipeline's peak is its largest position's.
  const auto pipeline = std::find_if(all.begin(), all.end(), [](const auto& l) { return l.config.parallel.pp == 2; });
  ASSERT_NE(pipeline, all.end());
  int64_t largest = 0;
  for (const DryRunReport& r : dry_run_pipeline(pipeline->config, 2, 0)) largest = std::max(largest, r.peak_bytes);
  EXPECT_EQ(pipeline->peak_bytes, largest);
  // A limit between the peaks: the fitting ones first, by estimate; the others after, by peak.
  std::vector<int64_t> peaks;
  for (const PlannedLayout& l : all) peaks.push_back(l.peak_bytes);
  std::sort(peaks.begin(), peaks.end());
  options.memory_limit_bytes = static_cast<int64_t>(peaks[peaks.size() / 2] * 1.1);
  options.allocator_slack = 0.1;
  all = plan_layouts(c, cal, options);
  bool fitting = true;
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(all[i].fits, all[i].peak_bytes * 1.1 <= options.memory_limit_bytes) << all[i].describe();
    if (!all[i].fits) fitting = false;
    EXPECT_TRUE(all[i].fits || !fitting);
    if (i > 0 && all[i].fits) EXPECT_LE(all[i - 1].estimate.seconds, all[i].estimate.seconds);
    if (i > 0 && !all[i].fits && !all[i - 1].fits) EXPECT_LE(all[i - 1].peak_bytes, all[i].peak_bytes);
  }
  EXPECT_TRUE(all.front().fits);
  EXPECT_FALSE(all.back().fits);
  // Without a calibration (hp-plan without one): by peak.
  options.memory_limit_bytes = 0;
  all = plan_layouts(c, options);
  for (size_t i = 1; i < all.size(); ++i) EXPECT_LE(all[i - 1].peak_bytes, all[i].peak_bytes);
  EXPECT_EQ(all.front().estimate.seconds, 0.0);
}

}  // namespace
}  // namespace hp::train
