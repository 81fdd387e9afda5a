// Pipelined training steps against the same step on one device: every schedule, 2 and 4 ranks,
// several micro-batch counts; the loss within 1e-6, every parameter gradient within 2e-6 of its largest value.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <optional>

#include "hp/core/memory_tracker.h"
#include "hp/core/recompute.h"
#include "hp/models/llama/parallelize.h"
#include "hp/models/llama/pipeline.h"
#include "hp/nn/init.h"
#include "hp/parallel/activation_swap.h"
#include "hp/parallel/checkpoint.h"
#include "hp/parallel/fsdp.h"
#include "hp/parallel/loss_parallel.h"
#include "hp/pp/executor.h"
#include "test_util.h"

namespace hp::pp {
namespace {

constexpr int64_t kLayers = 8, kRows = 40, kSeq = 8;
constexpr uint64_t kSeed = 11;

models::LlamaConfig config() {
  models::LlamaConfig c;
  c.layers = kLayers;
  c.max_seq = kSeq;
  return c;
}

std::pair<at::Tensor, at::Tensor> batch() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor tokens =
      at::randint(0, config().vocab, {kRows, kSeq + 1}, gen, at::TensorOptions().dtype(at::kLong));
  return {tokens.narrow(1, 0, kSeq).contiguous(), tokens.narrow(1, 1, kSeq).contiguous()};
}

at::Tensor loss_fn(const at::Tensor& logits, const at::Tensor& targets) { return cross_entropy(logits, targets); }

struct Reference {
  double loss;
  std::map<std::string, at::Tensor> grads;
};

// One device: the whole batch at once (the mean of equal micro-batch means is the overall mean).
Reference one_device(const at::Tensor& x, const at::Tensor& y) {
  models::Llama model(config());
  nn::init_parameters(model, kSeed);
  at::Tensor loss = loss_fn(model(x), y);
  loss.backward();
  Reference out{loss.item<double>(), {}};
  for (const auto& item : model.named_parameters()) out.grads[item.key()] = item.value().grad().clone();
  return out;
}

const Reference& reference() {
  static const Reference r = [] {
    auto [x, y] = batch();
    return one_device(x, y);
  }();
  return r;
}

// The loss and the gradients of `stages`' parameters against `want`; returns how many it checked.
int check_against(const Reference& want, double loss, models::Llama& model, const std::vector<PipelineStage>& stages,
                  const std::string& what) {
  test::check_relative(at::scalar_tensor(loss), at::scalar_tensor(want.loss), what + ": loss", 1e-6);
  std::map<const void*, std::string> fqn;
  for (const auto& item : model.named_parameters()) fqn[item.value().unsafeGetTensorImpl()] = item.key();
  int checked = 0;
  for (const auto& st : stages)
    for (const at::Tensor& param : st.module->parameters()) {
      const auto name = fqn.find(param.unsafeGetTensorImpl());
      if (name == fqn.end()) continue;  // a wrapper's own parameter
      if (!param.grad().defined()) throw std::runtime_error(what + ": no gradient for " + name->second);
      // fp32: the micro-batches' gradients add up in another order than one backward over the whole
      // batch does; measured up to 1.1e-6 of the largest gradient value (layers.6's q_proj).
      test::check_relative(param.grad(), want.grads.at(name->second), what + ": grad of " + name->second, 2e-6);
      ++checked;
    }
  return checked;
}

// `model` split into the schedule's stages (equal layer ranges): the ones `rank` runs.
std::vector<PipelineStage> stages_of(models::Llama& model, const Schedule& schedule, int rank) {
  const auto all = models::split_llama(model, std::vector<int64_t>(schedule.stages, kLayers / schedule.stages));
  std::vector<PipelineStage> mine;
  for (int s = 0; s < schedule.stages; ++s)
    if (schedule.stage_rank[s] == rank) mine.push_back({all[s], s});
  return mine;
}

// Every W action of `program` (this rank's) restarted from the recorded branch points, stage 0's
// from its embedding, instead of walking the stage's graph again.
void expect_every_w_split(const PipelineExecutor& pipe, const std::vector<Action>& program, const std::string& what) {
  int w_actions = 0;
  for (const Action& a : program) w_actions += a.kind == ActionKind::kBackwardWeight;
  if (pipe.split_weight_actions() != w_actions)
    throw std::runtime_error(what + ": " + std::to_string(pipe.split_weight_actions()) + " of " +
                             std::to_string(w_actions) + " W actions used the split");
}

// Runs two steps of `make(p, m)` on p ranks; checks the second step's loss and the gradients of
// each rank's stages (the first step exchanges the shapes; the second batches every receive).
template <typename Make>
void check_schedule(const Make& make, int p, int m, const std::string& what, PipelineOptions options = {}) {
  reference();
  test::run(p, [&](const comm::ProcessGroup& world) {
    const Schedule schedule = make(p, m);
    models::Llama model(config());
    nn::init_parameters(model, kSeed);
    const std::vector<PipelineStage> mine = stages_of(model, schedule, world.rank());
    PipelineExecutor pipe(schedule, mine, world, loss_fn, options);
    auto [x, y] = batch();
    pipe.step(x, y);
    for (const at::Tensor& param : model.parameters()) param.mutable_grad() = at::Tensor();
    const double loss = pipe.step(x, y);
    // Every receive is posted ahead, but a backward one that comes right after its own stage's
    // forward (V-Min at p 2 runs a micro-batch's I next to its F): its shape is what that forward
    // sends.
    int receives = 0;
    std::optional<Action> computed;
    for (const Action& a : schedule.programs[world.rank()]) {
      if (a.is_compute()) computed = a;
      const bool after_own_forward = a.kind == ActionKind::kRecvBackward && computed &&
                                     *computed == Action{ActionKind::kForward, a.stage, a.micro_batch};
      receives += (a.kind == ActionKind::kRecvForward || a.kind == ActionKind::kRecvBackward) && !after_own_forward;
    }
    if (pipe.batched_receives() != (options.batch_p2p ? receives : 0))
      throw std::runtime_error(what + ": " + std::to_string(pipe.batched_receives()) + " of " +
                               std::to_string(receives) + " receives were batched");
    if (check_against(reference(), loss, model, mine, what) == 0)
      throw std::runtime_error(what + ": rank " + std::to_string(world.rank()) + " checked nothing");
    expect_every_w_split(pipe, schedule.programs[world.rank()], what);
    if (schedule.name == "1F1B")
      for (const auto& st : mine)
        if (pipe.peak_live_micro_batches(st.index) > p)
          throw std::runtime_error(what + ": 1F1B held " + std::to_string(pipe.peak_live_micro_batches(st.index)) +
                                   " micro-batches on stage " + std::to_string(st.index));
    // One stage per rank: the executor holds exactly what the schedule's programs say.
    if (schedule.stages == schedule.ranks) {
      const int held = pipe.peak_live_micro_batches(mine.front().index);
      const int planned = peak_in_flight(schedule)[world.rank()];
      if (held != planned)
        throw std::runtime_error(what + ": held " + std::to_string(held) + " micro-batches, the schedule " +
                                 std::to_string(planned));
    }
  });
}

TEST(Pipeline, EveryScheduleMatchesOneDevice) {
  for (int p : {2, 4})
    for (int m : {p, 2 * p, 5}) {
      const std::string shape = " p=" + std::to_string(p) + " m=" + std::to_string(m);
      check_schedule(gpipe, p, m, "GPipe" + shape);
      check_schedule(one_f_one_b, p, m, "1F1B" + shape);
      check_schedule([](int r, int mb) { return interleaved_1f1b(r, 2, mb); }, p, m, "Interleaved1F1B" + shape);
      check_schedule([](int r, int mb) { return zero_bubble_v(r, mb); }, p, m, "ZBV" + shape);
    }
  // Unbatched: each receive posted where its action stands.
  PipelineOptions unbatched;
  unbatched.batch_p2p = false;
  check_schedule(one_f_one_b, 4, 5, "1F1B unbatched", unbatched);
  check_schedule([](int r, int mb) { return zero_bubble_v(r, mb); }, 2, 5, "ZBV unbatched", unbatched);
}

// The zero-bubble family built for unequal costs (dear I, cheap W) runs as it was built.
TEST(Pipeline, ZeroBubbleSchedulesMatchOneDevice) {
  const ActionCosts costs{1.0, 2.0, 0.5};
  for (int p : {2, 4})
    for (int m : {p, 2 * p, 5}) {
      const std::string shape = " p=" + std::to_string(p) + " m=" + std::to_string(m);
      check_schedule([&](int r, int mb) { return zero_bubble_h1(r, mb, costs); }, p, m, "ZB-H1" + shape);
      check_schedule([&](int r, int mb) { return zero_bubble_h2(r, mb, costs); }, p, m, "ZB-H2" + shape);
      check_schedule([&](int r, int mb) { return zero_bubble_v(r, mb, costs); }, p, m, "ZBV (costs 1, 2, 0.5)" + shape);
      check_schedule([&](int r, int mb) { return v_half(r, mb, costs); }, p, m, "V-Half (costs 1, 2, 0.5)" + shape);
      check_schedule([](int r, int mb) { return v_min(r, mb); }, p, m, "V-Min" + shape);
    }
}

// reschedule takes another order of the same stages on the same ranks (which then matches one
// device), and refuses a schedule that places the stages elsewhere, naming both.
TEST(Pipeline, RescheduleTakesOnlyAnotherOrderOfTheSameStages) {
  reference();
  test::run(2, [&](const comm::ProcessGroup& world) {
    const Schedule first = zero_bubble_v(2, 4);
    models::Llama model(config());
    nn::init_parameters(model, kSeed);
    const std::vector<PipelineStage> mine = stages_of(model, first, world.rank());
    PipelineExecutor pipe(first, mine, world, loss_fn);
    test::expect_error([&] { pipe.reschedule(one_f_one_b(2, 4)); },
                       "schedule '1F1B' (2 ranks, 2 stages, 4 micro-batches) does not place the stages of 'ZBV'");
    test::expect_error([&] { pipe.reschedule(zero_bubble_v(2, 8)); }, "does not place the stages of 'ZBV'");
    // The same counts, the stages on other ranks (s % 2, not the V).
    test::expect_error([&] { pipe.reschedule(interleaved_1f1b(2, 2, 4)); },
                       "schedule 'Interleaved1F1B' (2 ranks, 4 stages, 4 micro-batches) does not place the stages");
    const Schedule ordered = zero_bubble_v(2, 4, {1.0, 2.0, 0.5});
    if (ordered.programs == first.programs) throw std::runtime_error("the reordered ZBV is the unit order");
    pipe.reschedule(ordered);
    auto [x, y] = batch();
    pipe.step(x, y);  // the shapes cross
    for (const at::Tensor& param : model.parameters()) param.mutable_grad() = at::Tensor();
    const double loss = pipe.step(x, y);
    if (check_against(reference(), loss, model, mine, "rescheduled ZBV") == 0)
      throw std::runtime_error("rank " + std::to_string(world.rank()) + " checked nothing");
  });
}

// Steps hold nothing over: after W the stage's graph, with its saved activations, is gone (a
// reference cycle through W's recording hooks once kept every graph alive).
TEST(Pipeline, StepsDoNotAccumulateMemory) {
  test::run(2, [&](const comm::ProcessGroup& world) {
    models::Llama model(config());
    nn::init_parameters(model, kSeed);
    const Schedule schedule = zero_bubble_v(2, 4);
    const std::vector<PipelineStage> mine = stages_of(model, schedule, world.rank());
    PipelineExecutor pipe(schedule, mine, world, loss_fn);
    auto [x, y] = batch();
    MemoryTracker tracker;
    std::vector<int64_t> held;
    for (int step = 0; step < 4; ++step) {
      pipe.step(x, y);
      held.push_back(test::settled_current(tracker));  // gradients (same size every step) and nothing else
    }
    if (held[3] != held[1])
      throw std::runtime_error("rank " + std::to_string(world.rank()) + " holds " + std::to_string(held[1]) +
                               " bytes after step 2 but " + std::to_string(held[3]) + " after step 4");
  });
}

// 1F1B's activations are bounded by the number of stages, not of micro-batches, in bytes too: a
// sent activation's buffer goes once the gradient answering it has come back, not at the end of
// the step. A step's peak with 8 micro-batches stays that of 4 (same micro-batch size): holding
// every sent activation (or gradient) to the end would add one per extra micro-batch.
TEST(Pipeline, OneFOneBPeakMemoryDoesNotGrowWithMicroBatches) {
  std::map<int, std::vector<int64_t>> peaks;  // per rank: the peak at m = 4, then m = 8
  std::mutex mu;
  for (int m : {4, 8})
    test::run(2, [&](const comm::ProcessGroup& world) {
      models::Llama model(config());
      nn::init_parameters(model, kSeed);
      const Schedule schedule = one_f_one_b(2, m);
      PipelineExecutor pipe(schedule, stages_of(model, schedule, world.rank()), world, loss_fn);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
      const at::Tensor tokens =
          at::randint(0, config().vocab, {4 * m, kSeq + 1}, gen, at::TensorOptions().dtype(at::kLong));
      const at::Tensor x = tokens.narrow(1, 0, kSeq).contiguous(), y = tokens.narrow(1, 1, kSeq).contiguous();
      pipe.step(x, y);  // gradients allocated; later steps accumulate into them
      MemoryTracker tracker;
      pipe.step(x, y);
      std::lock_guard<std::mutex> lock(mu);
      peaks[world.rank()].push_back(tracker.peak());
    });
  for (const auto& [rank, peak] : peaks) {
    ASSERT_EQ(peak.size(), 2u);
    const int64_t activation = 4 * kSeq * config().dim * static_cast<int64_t>(sizeof(float));  // one boundary message
    EXPECT_LT(peak[1] - peak[0], activation)
        << "rank " << rank << ": peak " << peak[0] << " bytes with 4 micro-batches, " << peak[1] << " with 8";
    std::cout << "rank " << rank << ": 1F1B peak " << peak[0] << " bytes with 4 micro-batches, " << peak[1]
              << " with 8\n";
  }
}

// A stage followed by a projection whose output carries a gradient hook (halving the gradient):
// the projection's backward node branches to its weight, so W restarts it. The hook ran in I and
// must not run again in W.
struct Hooked : nn::Module {
  Hooked(std::shared_ptr<nn::Module> stage, int64_t dim)
      : nn::Module("Hooked"),
        stage(register_module("stage", std::move(stage))),
        proj(register_module("proj", std::make_shared<nn::Linear>(dim, dim, false))) {}
  at::Tensor forward(const at::Tensor& x) override {
    const at::Tensor z = (*stage)(x);
    // A 2-D matmul, so the hooked tensor's node is the matmul's backward itself.
    at::Tensor y = at::mm(z.reshape({-1, z.size(-1)}), proj->param("weight").t());
    if (y.requires_grad()) y.register_hook([](const at::Tensor& g) { return g * 0.5; });
    return y.view(z.sizes());
  }
  std::shared_ptr<nn::Module> stage;
  std::shared_ptr<nn::Linear> proj;
};

TEST(Pipeline, GradientHooksInsideAStageRunOnceUnderZbv) {
  test::run(2, [&](const comm::ProcessGroup& world) {
    const Schedule schedule = zero_bubble_v(2, 4);
    models::Llama model(config());
    nn::init_parameters(model, kSeed);
    std::vector<std::shared_ptr<nn::Module>> all = models::split_llama(model, {2, 2, 2, 2});
    for (size_t s = 0; s + 1 < all.size(); ++s) {
      auto hooked = std::make_shared<Hooked>(all[s], config().dim);
      nn::init_parameters(*hooked->proj, kSeed + s);
      all[s] = hooked;
    }
    // One device first: the stages in a row on the whole batch.
    auto [x, y] = batch();
    at::Tensor h = x;
    for (const auto& st : all) h = (*st)(h);
    loss_fn(h, y).backward();
    std::map<const void*, at::Tensor> want;
    for (const auto& st : all)
      for (const at::Tensor& p : st->parameters()) {
        want[p.unsafeGetTensorImpl()] = p.grad().clone();
        p.mutable_grad() = at::Tensor();
      }
    std::vector<PipelineStage> mine;
    for (int s = 0; s < schedule.stages; ++s)
      if (schedule.stage_rank[s] == world.rank()) mine.push_back({all[s], s});
    PipelineExecutor pipe(schedule, mine, world, loss_fn);
    pipe.step(x, y);
    for (const auto& st : mine)
      for (const auto& item : st.module->named_parameters())
        test::check_relative(item.value().grad(), want.at(item.value().unsafeGetTensorImpl()),
                             "stage " + std::to_string(st.index) + " " + item.key(), 2e-6);  // 1.3e-6 seen
    expect_every_w_split(pipe, schedule.programs[world.rank()], "hooked stages");
  });
}

// Checkpointed blocks under the schedules that split the backward into I and W: I recomputes each
// block once per micro-batch and keeps the rebuilt graph, W takes the blocks' weight gradients from
// it (every W splits), and the gradients are bitwise those of the same schedule without
// checkpointing. Every swapped byte comes back once.
TEST(Pipeline, CheckpointedBlocksRecomputeOnceUnderZeroBubbleSchedules) {
  for (const Schedule& schedule : {zero_bubble_v(2, 4), zero_bubble_h1(2, 4), v_min(2, 4)})
    for (CheckpointMode mode : {CheckpointMode::kFull, CheckpointMode::kSelective, CheckpointMode::kSwap})
      test::run(2, [&](const comm::ProcessGroup& world) {
        const std::string what = schedule.name + ", " + checkpoint_mode_name(mode);
        const std::pair<at::Tensor, at::Tensor> data = batch();
        int recomputed = 0;
        // This rank's parameter gradients after a step, its blocks checkpointed as `as` says.
        const auto gradients = [&](CheckpointMode as) {
          models::Llama model(config());
          nn::init_parameters(model, kSeed);
          SwapOptions options;
          options.min_bytes = 0;  // the test model's outputs are small
          const std::vector<CheckpointedModule> regions = checkpoint_modules(model, "layers.*", as, options);
          for (auto& [fqn, layer] : nn::match_modules(model, "layers.*"))
            layer->register_forward_hook([&recomputed](nn::Module&, const nn::Inputs&, at::Tensor&) {
              recomputed += forward_pass() == ForwardPass::kRecompute;
            });
          const std::vector<PipelineStage> mine = stages_of(model, schedule, world.rank());
          PipelineExecutor pipe(schedule, mine, world, loss_fn);
          pipe.step(data.first, data.second);
          expect_every_w_split(pipe, schedule.programs[world.rank()], what);
          if (as == CheckpointMode::kSwap) {
            const SwapStats stats = regions.front().swap()->stats();
            if (stats.swapped_bytes == 0) throw std::runtime_error(what + ": nothing was swapped");
            if (stats.reloaded_bytes != stats.swapped_bytes || stats.pool_in_use != 0)
              throw std::runtime_error(what + ": " + std::to_string(stats.reloaded_bytes) + " of " +
                                       std::to_string(stats.swapped_bytes) + " swapped bytes came back, " +
                                       std::to_string(stats.pool_in_use) + " still in the pool");
          }
          std::vector<at::Tensor> grads;
          for (const PipelineStage& st : mine)
            for (const at::Tensor& p : st.module->parameters()) grads.push_back(p.grad());
          return std::make_pair(grads, mine.size());
        };
        const auto [plain, stages] = gradients(CheckpointMode::kNone);
        const auto [checkpointed, same_stages] = gradients(mode);
        ASSERT_EQ(plain.size(), checkpointed.size());
        for (size_t i = 0; i < plain.size(); ++i)
          if (!checkpointed[i].defined() || !at::equal(checkpointed[i], plain[i]))
            throw std::runtime_error(what + ": parameter gradient " + std::to_string(i) + " differs");
        const int blocks = static_cast<int>(stages) * kLayers / schedule.stages;
        if (recomputed != blocks * 4)
          throw std::runtime_error(what + ": " + std::to_string(recomputed) + " recomputations of " +
                                   std::to_string(blocks) + " blocks over 4 micro-batches");
      });
}

// A stage 0 that takes [seq, batch] tokens (and its loss [seq, batch] targets): micro-batches split
// the declared batch dim 1. A batch dim the inputs lack is refused on every rank.
struct SeqFirst : nn::Module {
  explicit SeqFirst(std::shared_ptr<nn::Module> stage)
      : nn::Module("SeqFirst"), stage(register_module("stage", std::move(stage))) {}
  at::Tensor forward(const at::Tensor& x) override { return (*stage)(x.t().contiguous()); }
  std::shared_ptr<nn::Module> stage;
};

TEST(Pipeline, MicroBatchesSplitTheDeclaredBatchDim) {
  reference();
  test::run(2, [&](const comm::ProcessGroup& world) {
    const Schedule schedule = zero_bubble_v(2, 4);
    models::Llama model(config());
    nn::init_parameters(model, kSeed);
    std::vector<PipelineStage> mine = stages_of(model, schedule, world.rank());
    for (PipelineStage& st : mine)
      if (st.index == 0) st.module = std::make_shared<SeqFirst>(st.module);
    PipelineOptions options;
    options.batch_dim = 1;
    PipelineExecutor pipe(
        schedule, mine, world,
        [](const at::Tensor& logits, const at::Tensor& targets) { return loss_fn(logits, targets.t().contiguous()); },
        options);
    auto [x, y] = batch();
    const double loss = pipe.step(x.t(), y.t());
    check_against(reference(), loss, model, mine, "batch dim 1");
    expect_every_w_split(pipe, schedule.programs[world.rank()], "batch dim 1");
    test::expect_error([&] { pipe.step(x.t()[0], y.t()[0]); },
                       "micro-batches split dim 1 (PipelineOptions::batch_dim)");
  });
}

// Shapes that change between steps: with dynamic_shapes each step matches one device on its own
// batch; without, the sending stage refuses the new shape and every rank fails saying so.
TEST(Pipeline, DynamicShapesAreOptIn) {
  auto [x, y] = batch();
  const at::Tensor x5 = x.narrow(1, 0, 5).contiguous(), y5 = y.narrow(1, 0, 5).contiguous();
  const Reference want = one_device(x5, y5);
  for (const Schedule& schedule : {one_f_one_b(2, 4), zero_bubble_v(2, 4)}) {
    const std::string what = "dynamic shapes, " + schedule.name;
    test::run(2, [&](const comm::ProcessGroup& world) {
      models::Llama model(config());
      nn::init_parameters(model, kSeed);
      const std::vector<PipelineStage> mine = stages_of(model, schedule, world.rank());
      PipelineOptions options;
      options.dynamic_shapes = true;
      PipelineExecutor pipe(schedule, mine, world, loss_fn, options);
      pipe.step(x, y);
      for (const at::Tensor& param : model.parameters()) param.mutable_grad() = at::Tensor();
      check_against(want, pipe.step(x5, y5), model, mine, what);
    });
    try {
      testing::run_ranks(2, [&](const comm::ProcessGroup& world) {
        models::Llama model(config());
        nn::init_parameters(model, kSeed);
        PipelineExecutor pipe(schedule, stages_of(model, schedule, world.rank()), world, loss_fn);
        pipe.step(x, y);
        pipe.step(x5, y5);
      });
      ADD_FAILURE() << schedule.name << ": a changed shape without dynamic_shapes did not fail";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("2 of 2 ranks failed"), std::string::npos) << message;
      EXPECT_NE(message.find("set PipelineOptions::dynamic_shapes"), std::string::npos) << message;
    }
  }
}

// Inference through the stages (the trainer's sample): the logits of one device on every rank,
// for a V-shaped placement too, with sequence lengths that change from call to call.
TEST(Pipeline, ForwardGivesOneDeviceLogitsOnEveryRank) {
  models::Llama single(config());
  nn::init_parameters(single, kSeed);
  auto [x, y] = batch();
  test::run(2, [&](const comm::ProcessGroup& world) {
    models::Llama model(config());
    nn::init_parameters(model, kSeed);
    const Schedule schedule = zero_bubble_v(2, 2);
    const std::vector<PipelineStage> mine = stages_of(model, schedule, world.rank());
    PipelineExecutor pipe(schedule, mine, world, loss_fn);
    for (int64_t seq : {kSeq, int64_t{3}}) {
      const at::Tensor tokens = x.narrow(0, 0, 2).narrow(1, 0, seq);
      at::NoGradGuard no_grad;
      test::check_relative(pipe.forward(tokens), single(tokens), "pipeline forward, seq " + std::to_string(seq), 1e-6);
    }
  });
}

// A stage that works for its first `healthy` forwards and then fails.
struct Failing : nn::Module {
  Failing(std::shared_ptr<nn::Module> stage, int healthy)
      : nn::Module("Failing"), stage(register_module("stage", std::move(stage))), healthy(healthy) {}
  at::Tensor forward(const at::Tensor& x) override {
    if (healthy-- <= 0) throw std::runtime_error("bad stage");
    return (*stage)(x);
  }
  std::shared_ptr<nn::Module> stage;
  int healthy;
};

// Stage 2 of 4 throws in the second pass: every rank fails with an error naming it, well before
// the group timeout (which is longer than the watchdog, so a rank left waiting for a message fails
// the test). By then the shapes are known, so ranks have receives posted ahead, which are abandoned.
TEST(Pipeline, AFailingStageFailsEveryRankNamingIt) {
  for (const bool backward : {true, false}) {
    const std::string pass = backward ? "step" : "evaluate";
    try {
      testing::RunRanksOptions options;
      options.group.set_timeout(std::chrono::seconds(300));
      options.watchdog = std::chrono::seconds(60);
      testing::run_ranks(
          4,
          [&](const comm::ProcessGroup& world) {
            models::Llama model(config());
            nn::init_parameters(model, kSeed);
            auto all = models::split_llama(model, {2, 2, 2, 2});
            if (world.rank() == 2) all[2] = std::make_shared<Failing>(all[2], 8);
            PipelineExecutor pipe(one_f_one_b(4, 8), {{all[world.rank()], world.rank()}}, world, loss_fn);
            auto [x, y] = batch();
            for (int pass_index = 0; pass_index < 2; ++pass_index) backward ? pipe.step(x, y) : pipe.evaluate(x, y);
          },
          options);
      FAIL() << pass << ": expected the pass to fail";
    } catch (const TimeoutError& e) {
      FAIL() << pass << ": a rank was left waiting: " << e.what();
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("4 of 4 ranks failed"), std::string::npos) << what;
      const std::string cause = "pipeline stage 2 (rank 2) failed at 2F0 of schedule '1F1B': bad stage";
      for (int r = 0; r < 4; ++r) {
        const size_t line = what.find("\n  rank " + std::to_string(r) + ": ");
        ASSERT_NE(line, std::string::npos) << what;
        const std::string rank_error = what.substr(line, what.find('\n', line + 1) - line);
        EXPECT_NE(rank_error.find(cause), std::string::npos) << pass << ", rank " << r << ": " << rank_error;
        if (r != 2) {
          EXPECT_NE(rank_error.find("so rank " + std::to_string(r) + " stopped"), std::string::npos) << rank_error;
        }
      }
    }
  }
}

// After a failed step the executor refuses to run again (its ranks are out of step), and says why.
TEST(Pipeline, AnExecutorStopsAfterAFailedStep) {
  testing::RunRanksOptions options;
  options.barrier_at_exit = true;
  testing::run_ranks(
      2,
      [&](const comm::ProcessGroup& world) {
        models::Llama model(config());
        nn::init_parameters(model, kSeed);
        const auto all = models::split_llama(model, {4, 4});
        PipelineExecutor pipe(
            gpipe(2, 2), {{all[world.rank()], world.rank()}}, world,
            [](const at::Tensor&, const at::Tensor&) -> at::Tensor { throw std::runtime_error("bad loss"); });
        auto [x, y] = batch();
        for (int attempt = 0; attempt < 2; ++attempt) {
          try {
            pipe.step(x, y);
            throw std::runtime_error("the step did not fail");
          } catch (const Error& e) {
            const std::string what = e.what();
            const std::string expected = attempt == 0
                                             ? "pipeline stage 1 (rank 1) failed at 1F0 of schedule 'GPipe': bad loss"
                                             : "an earlier pass failed (pipeline stage 1";
            if (what.find(expected) == std::string::npos)
              throw std::runtime_error("attempt " + std::to_string(attempt) + ": " + what);
          }
        }
      },
      options);
}

}  // namespace
}  // namespace hp::pp

namespace hp::pp {
namespace {

// MPMD stage meshes on 3 ranks: stage 0 (embedding and 4 blocks) on rank 0 alone, stage 1 (4 blocks,
// norm, head and loss) on ranks 1 and 2, tensor-parallel; with sequence parallelism stage 1 takes
// its input sharded on the sequence dim. The loss and every gradient equal one device within 1e-5.
TEST(Pipeline, MpmdStageOnATensorParallelMeshMatchesOneDevice) {
  reference();
  for (const bool sequence_parallel : {false, true}) {
    const std::string what = sequence_parallel ? "MPMD (TP + SP)" : "MPMD (TP)";
    test::run(3, [&](const comm::ProcessGroup& world) {
      models::Llama model(config());
      if (world.rank() > 0) {
        const DeviceMesh tp(world, "cpu", {2}, {1, 2}, {"tp"});
        parallelize_module(model, tp, models::llama_tp_plan({sequence_parallel, false}));
      }
      nn::init_parameters(model, kSeed);
      const auto stages = models::split_llama(model, {kLayers / 2, kLayers / 2});
      const int index = world.rank() == 0 ? 0 : 1;
      PipelineStage stage{stages[index], index};
      if (index == 1 && sequence_parallel) stage.input_shard_dim = 1;
      PipelineOptions options;
      options.position_ranks = {{0}, {1, 1}};
      try {
        PipelineExecutor bad(one_f_one_b(2, 4), {stage}, world, loss_fn, options);
        throw std::runtime_error("a rank named twice was accepted");
      } catch (const Error& e) {
        if (std::string(e.what()).find("rank 1 runs more than one position") == std::string::npos) throw;
      }
      options.position_ranks = {{0}, {1, 2}};
      PipelineExecutor pipe(one_f_one_b(2, 4), {stage}, world, loss_fn, options);
      auto [x, y] = batch();
      const double loss = pipe.step(x, y);
      test::check_relative(at::scalar_tensor(loss), at::scalar_tensor(reference().loss), what + ": loss", 1e-5);
      std::map<const void*, std::string> fqn;
      for (const auto& item : model.named_parameters()) fqn[item.value().unsafeGetTensorImpl()] = item.key();
      int sharded = 0;
      for (const at::Tensor& param : stage.module->parameters()) {
        const std::string& name = fqn.at(param.unsafeGetTensorImpl());
        sharded += is_dtensor(param);
        test::check_relative(test::whole(param.grad()), reference().grads.at(name), what + ": grad of " + name, 1e-5);
      }
      if (index == 1 && sharded == 0) throw std::runtime_error(what + ": stage 1 is not tensor-parallel");
      // Inference through the same placement gives every rank the logits, also for a sequence
      // length that does not split evenly over the TP ranks (uneven SP shards at the boundary).
      const at::Tensor tokens = batch().first;
      at::NoGradGuard no_grad;
      models::Llama single(config());
      nn::init_parameters(single, kSeed);
      for (int64_t seq : {kSeq, int64_t{5}}) {
        const at::Tensor prompt = tokens.narrow(0, 0, 2).narrow(1, 0, seq);
        test::check_relative(pipe.forward(prompt), single(prompt), what + ": forward, seq " + std::to_string(seq),
                             1e-5);
      }
    });
  }
}

// Tied embeddings across stages: the first stage's embedding and the last stage's head share one
// weight. Each holds a copy; after the step both copies' gradients equal one device's (the sum of
// the embedding's and the head's), for 1F1B on 2 ranks and interleaved on 2 ranks x 2 stages, with
// and without FSDP on the stages.
TEST(Pipeline, TiedEmbeddingsAcrossStagesMatchOneDevice) {
  models::LlamaConfig tied = config();
  tied.tie_embeddings = true;
  models::Llama single(tied);
  nn::init_parameters(single, kSeed);
  auto [x, y] = batch();
  const at::Tensor single_loss = loss_fn(single(x), y);
  single_loss.backward();
  const at::Tensor want = single.embed->param("weight").grad();
  for (const bool interleaved : {false, true})
    for (const bool fsdp : {false, true}) {
      const std::string what = std::string(interleaved ? "interleaved" : "1F1B") + (fsdp ? " x FSDP" : "");
      test::run(fsdp ? 4 : 2, [&](const comm::ProcessGroup& world) {
        const DeviceMesh mesh = init_device_mesh(world, "cpu", {world.size() / 2, 2}, {"dp", "pp"});
        const Schedule schedule = interleaved ? interleaved_1f1b(2, 2, 4) : one_f_one_b(2, 4);
        models::Llama model(tied);
        const auto all = models::split_llama(model, std::vector<int64_t>(schedule.stages, kLayers / schedule.stages));
        const int pp_rank = static_cast<int>(mesh.get_local_rank("pp"));
        std::vector<PipelineStage> mine;
        for (int s = 0; s < schedule.stages; ++s)
          if (schedule.stage_rank[s] == pp_rank) {
            if (fsdp) fully_shard(*all[s], mesh["dp"]);
            mine.push_back({all[s], s});
          }
        nn::init_parameters(model, kSeed);
        PipelineOptions options;
        options.tied = {{"embed.weight", {0, schedule.stages - 1}}};
        PipelineExecutor pipe(schedule, mine, mesh.get_group("pp"), loss_fn, options);
        const int64_t half = kRows / mesh.size("dp"), first = mesh.get_local_rank("dp") * half;
        const double loss = pipe.step(x.narrow(0, first, half), y.narrow(0, first, half));
        if (!fsdp) test::check_relative(at::scalar_tensor(loss), single_loss.detach(), what + ": loss", 1e-6);
        for (const auto& st : mine)
          for (const auto& item : st.module->named_parameters())
            if (item.key() == "embed.weight")
              test::check_relative(test::whole(item.value().grad()), want,
                                   what + ": grad of the tied weight on stage " + std::to_string(st.index), 1e-6);
      });
    }
}

// PP x FSDP on 4 ranks: 2 positions x dp 2. Each stage is one fully_shard unit on its data-parallel
// mesh; each pipeline (one per dp index) runs half the batch; FSDP averages the gradients over dp.
// Under ZBV the W actions split off the units' gathers too (their backward reduce-scatters once).
TEST(Pipeline, TimesFsdpMatchesOneDevice) {
  reference();
  for (const Schedule& schedule :
       {one_f_one_b(2, 4), zero_bubble_v(2, 4), zero_bubble_h1(2, 4), zero_bubble_h2(2, 4), v_half(2, 4), v_min(2, 4)})
    test::run(4, [&](const comm::ProcessGroup& world) {
      const std::string what = "PP (" + schedule.name + ") x FSDP";
      const DeviceMesh mesh = init_device_mesh(world, "cpu", {2, 2}, {"pp", "dp"});
      const int position = static_cast<int>(mesh.get_local_rank("pp"));
      const int dp_rank = static_cast<int>(mesh.get_local_rank("dp"));
      models::Llama model(config());
      const std::vector<PipelineStage> mine = stages_of(model, schedule, position);
      for (const PipelineStage& st : mine) fully_shard(*st.module, mesh["dp"]);
      nn::init_parameters(model, kSeed);
      PipelineExecutor pipe(schedule, mine, mesh.get_group("pp"), loss_fn);
      auto [x, y] = batch();
      const int64_t half = kRows / 2;
      const double loss = pipe.step(x.narrow(0, dp_rank * half, half), y.narrow(0, dp_rank * half, half));
      const double mean = mesh.get_group("dp")
                              .all_reduce(at::scalar_tensor(loss, at::kDouble).reshape({1}), {comm::ReduceOp::kAvg})
                              .item<double>();
      test::check_relative(at::scalar_tensor(mean), at::scalar_tensor(reference().loss), what + ": loss", 1e-5);
      std::map<const void*, std::string> fqn;
      for (const auto& item : model.named_parameters()) fqn[item.value().unsafeGetTensorImpl()] = item.key();
      for (const PipelineStage& st : mine)
        for (const at::Tensor& param : st.module->parameters()) {
          const std::string& name = fqn.at(param.unsafeGetTensorImpl());
          if (!is_dtensor(param)) throw std::runtime_error(what + ": " + name + " is not sharded");
          test::check_relative(test::whole(param.grad()), reference().grads.at(name), what + ": grad of " + name, 1e-5);
        }
      expect_every_w_split(pipe, schedule.programs[position], what);
    });
}

}  // namespace
}  // namespace hp::pp
