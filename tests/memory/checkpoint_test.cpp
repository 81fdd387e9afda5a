// Activation checkpointing (hp/parallel/checkpoint.h): what a region keeps after forward, exactly,
// what its backward recomputes, counted by a dispatch mode, and gradients bitwise equal to the
// same model without checkpointing, with dropout, tensor parallelism, FSDP and expert parallelism.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <string>

#include "hp/comm/comm_debug_mode.h"
#include "hp/core/host_sync.h"
#include "hp/core/op_counter.h"
#include "hp/core/weight_split.h"
#include "hp/models/llama/model.h"
#include "hp/models/model_spec.h"
#include "hp/nn/init.h"
#include "hp/nn/layers.h"
#include "hp/nn/moe.h"
#include "hp/parallel/checkpoint.h"
#include "hp/parallel/parallel_dims.h"
#include "hp/train/config.h"
#include "test_util.h"

namespace hp::test {
namespace {

constexpr int64_t kWidth = 512;
constexpr int64_t kMatrixBytes = kWidth * kWidth * 4;  // one [512, 512] fp32 activation

std::shared_ptr<nn::Sequential> three_linears(bool dropout = false) {
  auto model = std::make_shared<nn::Sequential>();
  for (int i = 0; i < 3; ++i) {
    model->push_back(std::make_shared<nn::Linear>(kWidth, kWidth));
    if (dropout && i == 0) model->push_back(std::make_shared<nn::Dropout>(0.5));
  }
  nn::init_parameters(*model, 11);
  return model;
}

// three_linears, checkpointed whole: fully, or selectively under the default policy.
std::shared_ptr<nn::Sequential> checkpointed_linears(bool selective, bool dropout = false) {
  auto model = three_linears(dropout);
  CheckpointOptions options;
  if (selective) options.policy = default_checkpoint_policy;
  checkpoint(*model, options);
  return model;
}

struct Measured {
  int64_t bytes_after_forward = 0;  // allocated by forward and still held
  OpCounter backward;               // the ops backward ran
  CheckpointStats stats;
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
};

// One forward and backward of `model` on a fixed [512, 512] input (no gradient of its own).
Measured forward_backward(nn::Module& model, const std::optional<CheckpointedModule>& region = std::nullopt) {
  const at::Tensor x = at::randn({kWidth, kWidth}, at::make_generator<at::CPUGeneratorImpl>(3));
  Measured m;
  at::Tensor out;
  {
    MemoryTracker tracker;
    out = model(x);
    m.bytes_after_forward = tracker.current();
  }
  m.loss = out.pow(2).mean();
  {
    DispatchModeGuard on(m.backward);
    m.loss.backward();
  }
  if (region) m.stats = region->stats();
  for (const auto& item : model.named_parameters()) m.grads[item.key()] = item.value().grad().clone();
  return m;
}

void expect_same_gradients(const Measured& got, const Measured& want, const std::string& what) {
  check_close(got.loss, want.loss, what + ": loss", /*bitwise=*/true);
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (const auto& [name, grad] : want.grads) check_close(got.grads.at(name), grad, what + ": " + name, true);
}

// The toy: three 512-wide linears on a 512 x 512 input. Without checkpointing, forward
// keeps each linear's output: the next linear saves it for its weight gradient, the last is the
// output (3 matrices). Backward runs 2 products per linear (input and weight gradients) but 1 for the
// first, whose input needs no gradient: 5 mm; the forward's 3 addmm run again only as recomputed.
TEST(ActivationCheckpoint, ToyLinearsKeepExactlyWhatTheModeSaysAndRecomputeWhatItDropped) {
  auto plain_model = three_linears();
  const Measured plain = forward_backward(*plain_model);
  EXPECT_EQ(plain.bytes_after_forward, 3 * kMatrixBytes);
  EXPECT_EQ(plain.backward.count("aten::mm"), 5);
  EXPECT_EQ(plain.backward.count("aten::addmm"), 0);

  struct Case {
    std::string name;
    CheckpointPolicyFn policy;
    int64_t kept_matrices;  // after forward, the output included
    int64_t recomputed_products;
  };
  const auto save_all_but = [](int64_t recompute) {
    return [recompute](const CheckpointOp& op) {
      if (op.matmul_index < 0) return CheckpointPolicy::kMustRecompute;
      return op.matmul_index == recompute ? CheckpointPolicy::kMustRecompute : CheckpointPolicy::kMustSave;
    };
  };
  const std::vector<Case> cases = {
      {"full", nullptr, 1, 3},  // the output only; all three products again
      // Products 0 and 2 saved: the first linear's output and the output itself.
      {"selective (default policy)", default_checkpoint_policy, 2, 1},
      {"selective (every product)", save_all_but(-1), 3, 0},
      {"selective (product 0 forced to recompute)", save_all_but(0), 2, 1},
  };
  for (const Case& c : cases) {
    auto model = three_linears();
    CheckpointOptions options;
    options.policy = c.policy;
    const CheckpointedModule region = checkpoint(*model, options);
    const Measured m = forward_backward(*model, region);
    EXPECT_EQ(m.bytes_after_forward, c.kept_matrices * kMatrixBytes) << c.name;
    EXPECT_EQ(m.backward.count("aten::mm"), 5) << c.name;
    EXPECT_EQ(m.backward.count("aten::addmm"), c.recomputed_products) << c.name;
    EXPECT_EQ(m.backward.matmul_flops(),
              plain.backward.matmul_flops() + c.recomputed_products * 2 * kWidth * kWidth * kWidth)
        << c.name;
    if (c.policy) {
      // The stats count what the policy kept: here every kept matrix (the output is one of them).
      EXPECT_EQ(m.stats.saved_bytes, c.kept_matrices * kMatrixBytes) << c.name;
      EXPECT_EQ(m.stats.replayed_ops, 3 - c.recomputed_products) << c.name;
    }
    expect_same_gradients(m, plain, c.name);
  }
}

// A backward split into I and W (hp/core/weight_split.h, a zero-bubble pipeline's) asks a region
// for its input's gradient, then for its weights': I recomputes the products its policy did not
// save and runs the three input-side ones, W the three weight-side ones alone, as W does without
// checkpointing,
// with the same gradients bit for bit. An autograd::grad of the input alone (the graph not kept)
// recomputes and runs the input side, and holds nothing afterwards.
TEST(ActivationCheckpoint, ASplitBackwardRecomputesInIAndRunsOnlyTheWeightSideInW) {
  const at::Tensor x0 = at::randn({kWidth, kWidth}, at::make_generator<at::CPUGeneratorImpl>(3));
  struct Passes {
    OpCounter input, weight;
    at::Tensor dx;
    std::map<std::string, at::Tensor> grads;
  };
  const auto split_backward = [&](nn::Module& model) {
    Passes p;
    const at::Tensor x = x0.clone().requires_grad_();
    const at::Tensor loss = model(x).pow(2).mean();
    const auto split = WeightGradientSplit::prepare(loss, x, model.parameters());
    EXPECT_NE(split, nullptr);
    {
      DispatchModeGuard on(p.input);
      p.dx = split->input_gradient(loss, x, at::Tensor());
    }
    for (const at::Tensor& w : model.parameters()) EXPECT_FALSE(w.grad().defined()) << "a weight gradient in I";
    {
      DispatchModeGuard on(p.weight);
      split->weight_gradients();
    }
    for (const auto& item : model.named_parameters()) p.grads[item.key()] = item.value().grad();
    return p;
  };
  auto plain_model = three_linears();
  const Passes plain = split_backward(*plain_model);
  EXPECT_EQ(plain.input.count("aten::mm"), 3);
  EXPECT_EQ(plain.weight.count("aten::mm"), 3);
  for (const bool selective : {false, true}) {
    const std::string what = selective ? "selective" : "full";
    auto model = checkpointed_linears(selective);
    const Passes p = split_backward(*model);
    EXPECT_EQ(p.input.count("aten::addmm"), selective ? 1 : 3) << what << ": the recomputed products";
    EXPECT_EQ(p.input.count("aten::mm"), 3) << what;
    EXPECT_EQ(p.weight.count("aten::mm"), 3) << what;
    EXPECT_EQ(p.weight.count("aten::addmm"), 0) << what << ": W recomputed";
    check_close(p.dx, plain.dx, what + ": input gradient", /*bitwise=*/true);
    for (const auto& [name, grad] : plain.grads) check_close(p.grads.at(name), grad, what + ": " + name, true);

    const at::Tensor x = x0.clone().requires_grad_();
    at::Tensor dx;
    OpCounter ops;
    MemoryTracker tracker;
    const at::Tensor loss = (*model)(x).pow(2).mean();
    const int64_t after_forward = tracker.current();
    {
      DispatchModeGuard on(ops);
      dx = torch::autograd::grad({loss}, {x})[0];
    }
    check_close(dx, plain.dx, what + ": autograd::grad of the input", true);
    EXPECT_EQ(ops.count("aten::mm"), 3) << what << ": the input side alone";
    // What forward kept (the output; selective: and the first product's) is gone with the graph's
    // buffers, the input gradient has come, and no recomputed graph stays behind.
    const int64_t kept = (selective ? 2 : 1) * kMatrixBytes;
    EXPECT_EQ(tracker.current(), after_forward - kept + kMatrixBytes) << what << ": the graph, still alive, holds more";
  }
}

// An autograd::grad of the input alone that keeps the graph is taken for a split's I; a backward
// after it that is no W of that split (another loss of the same output, the parameters' gradients
// alone) recomputes the region, and its gradients are those of that loss.
TEST(ActivationCheckpoint, ABackwardAfterAnInputPassThatKeptTheGraphRecomputes) {
  const at::Tensor x0 = at::randn({kWidth, kWidth}, at::make_generator<at::CPUGeneratorImpl>(3));
  auto plain_model = three_linears();
  const at::Tensor xp = x0.clone().requires_grad_();
  const at::Tensor out_p = (*plain_model)(xp);
  const at::Tensor dx_p = torch::autograd::grad({out_p.pow(2).mean()}, {xp}, {}, /*retain_graph=*/true)[0];
  torch::autograd::backward({out_p.sum()}, {}, false, false, plain_model->parameters());
  for (const bool selective : {false, true}) {
    const std::string what = selective ? "selective" : "full";
    auto model = checkpointed_linears(selective);
    const at::Tensor x = x0.clone().requires_grad_();
    const at::Tensor out = (*model)(x);
    // The same output gradient, asking for the answered input again: no W either.
    const at::Tensor g = at::ones_like(out);
    const at::Tensor first = torch::autograd::grad({out}, {x}, {g}, /*retain_graph=*/true)[0];
    const at::Tensor again = torch::autograd::grad({out}, {x}, {g}, /*retain_graph=*/true)[0];
    check_close(again, first, what + ": the input's gradient asked again", true);
    const at::Tensor dx = torch::autograd::grad({out.pow(2).mean()}, {x}, {}, /*retain_graph=*/true)[0];
    check_close(dx, dx_p, what + ": autograd::grad of the input", true);
    OpCounter ops;
    {
      DispatchModeGuard on(ops);
      torch::autograd::backward({out.sum()}, {}, false, false, model->parameters());
    }
    // Selective too recomputes all three: what its first pass saved went with the input pass.
    EXPECT_EQ(ops.count("aten::addmm"), 3) << what << ": the backward recomputes the region";
    std::map<std::string, at::Tensor> grads;
    for (const auto& item : model->named_parameters()) grads[item.key()] = item.value().grad();
    for (const auto& item : plain_model->named_parameters())
      check_close(grads.at(item.key()), item.value().grad(), what + ": " + item.key(), true);
  }
}

// A region whose second input is made from a weight outside it: that input is off the path from
// the output to the split's input, so its gradient comes in W, with the weights'. The region still
// recomputes once, in I.
struct AddsABias : nn::Module {
  AddsABias()
      : nn::Module("AddsABias"), linear(register_module("linear", std::make_shared<nn::Linear>(kWidth, kWidth))) {
    nn::init_parameters(*this, 5);
  }
  at::Tensor forward_inputs(const nn::Inputs& in) override { return (*linear)(in[0]) + in[1]; }
  std::shared_ptr<nn::Linear> linear;
};

TEST(ActivationCheckpoint, AnInputOffTheSplitsPathGetsItsGradientInW) {
  const at::Tensor x0 = at::randn({kWidth, kWidth}, at::make_generator<at::CPUGeneratorImpl>(3));
  const at::Tensor b0 = at::randn({kWidth}, at::make_generator<at::CPUGeneratorImpl>(4));
  struct Result {
    at::Tensor dx, db, dweight;
    OpCounter weight_pass;
  };
  const auto run = [&](bool checkpointed) {
    AddsABias region;
    if (checkpointed) checkpoint(region, CheckpointOptions{});
    const at::Tensor x = x0.clone().requires_grad_(), b = b0.clone().requires_grad_();
    const at::Tensor loss = region(x, b * 2).pow(2).mean();
    const auto split =
        WeightGradientSplit::prepare(loss, x, {region.linear->param("weight"), region.linear->param("bias"), b});
    EXPECT_NE(split, nullptr);
    Result r;
    r.dx = split->input_gradient(loss, x, at::Tensor());
    {
      DispatchModeGuard on(r.weight_pass);
      split->weight_gradients();
    }
    r.db = b.grad();
    r.dweight = region.linear->param("weight").grad();
    return r;
  };
  const Result plain = run(false), checkpointed = run(true);
  check_close(checkpointed.dx, plain.dx, "input gradient", /*bitwise=*/true);
  check_close(checkpointed.db, plain.db, "the outside weight's gradient", true);
  check_close(checkpointed.dweight, plain.dweight, "the linear's weight gradient", true);
  EXPECT_EQ(checkpointed.weight_pass.count("aten::addmm"), 0) << "W recomputed the region";
}

// Dropout inside the region: the recomputation draws the same mask (its stream is replayed), so
// loss and gradients are those of the same model without checkpointing, bitwise.
TEST(ActivationCheckpoint, DropoutRecomputesTheSameMask) {
  auto plain_model = three_linears(/*dropout=*/true);
  const Measured plain = forward_backward(*plain_model);
  for (const bool selective : {false, true}) {
    auto model = checkpointed_linears(selective, /*dropout=*/true);
    expect_same_gradients(forward_backward(*model), plain, selective ? "selective" : "full");
  }
}

// No leaks: after each of three steps (forward, backward, gradients dropped) a region holds the same
// bytes as after the first, in every mode.
TEST(ActivationCheckpoint, StepsHoldTheSameBytesAfterTheFirst) {
  const at::Tensor x = at::randn({64, kWidth});
  for (const auto& policy : std::vector<CheckpointPolicyFn>{nullptr, default_checkpoint_policy}) {
    auto model = three_linears(/*dropout=*/true);
    CheckpointOptions options;
    options.policy = policy;
    checkpoint(*model, options);
    MemoryTracker tracker;
    std::vector<int64_t> held;
    for (int step = 0; step < 3; ++step) {
      (*model)(x).pow(2).mean().backward();
      for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
      held.push_back(tracker.current());
    }
    EXPECT_EQ(held[0], 0) << (policy ? "selective" : "full");
    EXPECT_EQ(held[2], held[0]) << (policy ? "selective" : "full");
  }
}

// Dropout on a DTensor draws from the mesh's distributed RNG: the recomputation gets the first
// pass's stream back, so the input's gradient (the mask, scaled) is bitwise the plain one.
TEST(ActivationCheckpoint, DistributedRngStreamsAreReplayed) {
  run(2, [](const comm::ProcessGroup& g) {
    at::Tensor grads[2];
    for (const bool checkpointed : {false, true}) {
      const DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});  // a new root: stream 0 again
      auto dropout = std::make_shared<nn::Dropout>(0.5);
      if (checkpointed) checkpoint(*dropout);
      const at::Tensor x = distribute_tensor(at::ones({8, 6}), mesh, {Shard(0)}).requires_grad_();
      ((*dropout)(x)*3.0).sum().backward();
      grads[checkpointed] = whole(x.grad());
    }
    check_close(grads[1], grads[0], "dropout on a DTensor", /*bitwise=*/true);
    HP_CHECK(at::equal(grads[0].eq(0).any(), at::ones({}, at::kBool)), "the mask dropped nothing");
  });
}

// A module that writes into a product's output in place: directly, or through matmul's result,
// which shares bmm's storage but not its version counter (matmul of 4-d inputs is an _unsafe_view of
// bmm's output).
class AddsInPlace : public nn::Module {
 public:
  // through_list: the add goes through a tensor-list argument (_foreach_add_, without autograd,
  // which has no formula for it), as an optimizer-like step inside a region would.
  explicit AddsInPlace(bool through_matmul = false, bool through_list = false)
      : nn::Module("AddsInPlace"), through_matmul_(through_matmul), through_list_(through_list) {
    add_param("weight", {kWidth, kWidth}, nn::Init::normal(0.0, 0.02));
  }

 protected:
  at::Tensor forward(const at::Tensor& x) override {
    const at::Tensor& w = param("weight");
    at::Tensor y = through_matmul_ ? at::matmul(x.view({1, 1, kWidth, kWidth}), w.view({1, 1, kWidth, kWidth}))[0][0]
                                   : at::mm(x, w);
    // After a policy saved mm's output.
    if (through_list_) {
      at::NoGradGuard no_grad;
      at::_foreach_add_(at::TensorList(y), 1.0);
    } else {
      y.add_(1.0);
    }
    return through_matmul_ ? y * y : y.relu();  // y * y's backward reads y
  }

 private:
  bool through_matmul_, through_list_;
};

// Saved outputs must be what the op returned. One the region itself changes in place (directly,
// through matmul's alias of it, or through a tensor-list argument) is dropped and its op
// recomputed (gradients still bitwise); one the caller changes after the region's forward (the
// region's output) is an error in backward, never a silent wrong gradient.
TEST(ActivationCheckpoint, SavedOutputsChangedInPlaceAreRecomputedOrRefused) {
  const auto save_all = [](const CheckpointOp&) { return CheckpointPolicy::kMustSave; };
  const at::Tensor x = at::randn({kWidth, kWidth}, at::make_generator<at::CPUGeneratorImpl>(8));
  for (const auto& [through_matmul, through_list] : {std::pair{false, false}, {true, false}, {true, true}}) {
    at::Tensor want;
    for (const bool checkpointed : {false, true}) {
      AddsInPlace m(through_matmul, through_list);
      nn::init_parameters(m, 3);
      std::optional<CheckpointedModule> region;
      if (checkpointed) region = checkpoint(m, {save_all});
      m(x).pow(2).mean().backward();
      if (!checkpointed) want = m.param("weight").grad().clone();
      if (checkpointed) {
        check_close(m.param("weight").grad(), want,
                    through_list     ? "through matmul and a tensor list"
                    : through_matmul ? "through matmul"
                                     : "in-place region",
                    /*bitwise=*/true);
        if (!through_matmul) {
          EXPECT_EQ(region->stats().replayed_ops, 1);  // relu; mm ran again
        }
      }
    }
  }
  auto linear = std::make_shared<nn::Linear>(kWidth, kWidth);
  nn::init_parameters(*linear, 3);
  checkpoint(*linear, {save_all});
  at::Tensor out = (*linear)(x);
  out.mul_(2.0);  // the region's output, which the policy saved
  expect_error([&] { out.sum().backward(); }, "was changed or freed in place after its region's forward");
}

// Eight products, each scaled in place through matmul's result (as attention kernels do with
// their scores) and summed: a policy that saves every product must let each go when it is
// overwritten, not hold all eight until the region's forward ends.
class OverwritesEachProduct : public nn::Module {
 public:
  OverwritesEachProduct() : nn::Module("OverwritesEachProduct") {
    add_param("weight", {kWidth, kWidth}, nn::Init::normal(0.0, 0.02));
  }

 protected:
  at::Tensor forward(const at::Tensor& x) override {
    const at::Tensor w = param("weight").view({1, 1, kWidth, kWidth});
    at::Tensor total = at::zeros({}, x.options());
    for (int i = 0; i < 8; ++i) total = total + at::matmul(x.view({1, 1, kWidth, kWidth}), w).mul_(1.0 + i).sum();
    return total;
  }
};

TEST(ActivationCheckpoint, OutputsOverwrittenInTheRegionAreReleasedAtOnce) {
  const auto save_all = [](const CheckpointOp&) { return CheckpointPolicy::kMustSave; };
  const at::Tensor x = at::randn({kWidth, kWidth}, at::make_generator<at::CPUGeneratorImpl>(8));
  int64_t peaks[2];
  for (const bool checkpointed : {false, true}) {
    OverwritesEachProduct m;
    nn::init_parameters(m, 3);
    std::optional<CheckpointedModule> region;
    if (checkpointed) region = checkpoint(m, {save_all});
    MemoryTracker tracker;
    const at::Tensor out = m(x);
    peaks[checkpointed] = tracker.peak();
  }
  const int64_t product = kWidth * kWidth * 4;
  EXPECT_LE(peaks[1], peaks[0] + product) << "a checkpointed forward held overwritten products";
}

// A module that reads a tensor it does not own.
class ReadsOutsideTensor : public nn::Module {
 public:
  explicit ReadsOutsideTensor(at::Tensor w) : nn::Module("ReadsOutsideTensor"), w_(std::move(w)) {}

 protected:
  at::Tensor forward(const at::Tensor& x) override { return x * w_; }

 private:
  at::Tensor w_;
};

// What a recomputation cannot honour is an error naming the region, not a wrong gradient: an input
// changed in place after the forward, a gradient through a tensor that is neither input nor
// parameter, a backward that records a graph of its own.
TEST(ActivationCheckpoint, WhatARecomputationCannotHonourIsRefused) {
  auto linear = std::make_shared<nn::Linear>(8, 8);
  nn::init_parameters(*linear, 3);
  checkpoint(*linear);
  const at::Tensor leaf = at::randn({4, 8}).requires_grad_();
  at::Tensor h = leaf * 1.0;
  const at::Tensor out = (*linear)(h);
  h.add_(1.0);
  expect_error([&] { out.sum().backward(); }, "input 0 of Linear was changed in place after its forward");

  ReadsOutsideTensor outside(at::ones({8}).requires_grad_());
  checkpoint(outside);
  expect_error([&] { outside(at::ones({4, 8})); }, "neither its input nor its parameter");

  const at::Tensor y = (*linear)(leaf).pow(2).sum();
  expect_error([&] { torch::autograd::grad({y}, {leaf}, {}, true, /*create_graph=*/true); },
               "a backward that records its own graph (create_graph, double backward)");
}

TEST(ActivationCheckpoint, NoGradRunsPlainlyAndAModuleIsCheckpointedOnce) {
  auto model = three_linears();
  checkpoint(*model);
  expect_error([&] { checkpoint(*model); }, "already checkpointed");
  at::NoGradGuard no_grad;
  const at::Tensor x = at::ones({2, kWidth});
  EXPECT_FALSE((*model)(x).requires_grad());
}

// A Llama block (attention with RoPE, SwiGLU MLP, RMSNorms, residuals): full checkpointing keeps
// exactly its output; selective keeps what its stats say; loss and gradients are bitwise equal.
TEST(ActivationCheckpoint, LlamaBlockKeepsItsOutputOrWhatThePolicySaved) {
  models::LlamaConfig config;
  config.dim = 64, config.heads = 4, config.kv_heads = 2, config.ffn_hidden = 96, config.max_seq = 32;
  const auto run_block = [&](std::optional<CheckpointMode> mode) {
    auto block = std::make_shared<models::Block>(config);
    nn::init_parameters(*block, 5);
    std::optional<CheckpointedModule> region;
    if (mode) {
      CheckpointOptions options;
      if (*mode == CheckpointMode::kSelective) options.policy = default_checkpoint_policy;
      region = checkpoint(*block, options);
    }
    const at::Tensor x = at::randn({2, 32, 64}, at::make_generator<at::CPUGeneratorImpl>(9)).requires_grad_();
    Measured m;
    at::Tensor out;
    {
      MemoryTracker tracker;
      out = (*block)(x);
      m.bytes_after_forward = tracker.current();
    }
    m.loss = out.pow(2).mean();
    m.loss.backward();
    if (region) m.stats = region->stats();
    for (const auto& item : block->named_parameters()) m.grads[item.key()] = item.value().grad().clone();
    m.grads["input"] = x.grad().clone();
    return std::make_pair(m, out.numel() * 4);
  };
  const auto [plain, output_bytes] = run_block(std::nullopt);
  const auto [full, unused1] = run_block(CheckpointMode::kFull);
  const auto [selective, unused2] = run_block(CheckpointMode::kSelective);
  EXPECT_EQ(full.bytes_after_forward, output_bytes);
  // Selective keeps its saved outputs besides the block's output (the residual sum, not a saved op).
  EXPECT_GT(selective.stats.saved_bytes, 0);
  EXPECT_EQ(selective.bytes_after_forward, output_bytes + selective.stats.saved_bytes);
  EXPECT_LT(selective.bytes_after_forward, plain.bytes_after_forward);
  expect_same_gradients(full, plain, "full");
  expect_same_gradients(selective, plain, "selective");
}

// One training forward and backward of a recipe-built model on `dims`, checkpointed as `mode` says:
// the loss, every gradient (whole), the collectives backward ran and its host reads, by rank.
struct RankRun {
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
  std::map<std::string, int64_t> backward_collectives;
  int64_t backward_host_syncs = 0;
  int64_t backward_topks = 0;    // routing decisions backward made
  at::Tensor tokens_per_expert;  // the first MoE layer's router's, after the step
};

std::vector<RankRun> run_recipe(const std::string& yaml, const ParallelDims& dims, CheckpointMode mode) {
  const train::TrainConfig c = train::parse_config(yaml, {});
  std::vector<RankRun> runs(static_cast<size_t>(dims.world_size()));
  run(static_cast<int>(dims.world_size()), [&](const comm::ProcessGroup& world) {
    models::RecipeOptions options;
    options.checkpoint = mode;
    const models::ModelParts parts = c.model->build(build_mesh(world, dims), dims, options);
    parts.init_parameters(7);
    // Each data-parallel rank its own batch; tensor-parallel ranks share theirs.
    const int64_t dp_rank = world.rank() / dims.tp;
    const at::Tensor data =
        at::randint(0, 64, {2, 17}, at::make_generator<at::CPUGeneratorImpl>(100 + dp_rank), at::kLong);
    RankRun& r = runs[static_cast<size_t>(world.rank())];
    r.loss = parts.loss((*parts.model)(data.narrow(1, 0, 16)), data.narrow(1, 1, 16));
    {
      comm::CommDebugMode comm;
      HostSyncCount syncs;
      OpCounter ops;
      {
        DispatchModeGuard on(ops);
        r.loss.backward();
      }
      r.backward_topks = ops.count("aten::topk");
      for (const char* op : {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"})
        r.backward_collectives[op] = comm.count(op);
      r.backward_host_syncs = syncs.count();
    }
    r.loss = whole(r.loss).detach();
    for (const auto& [fqn, p] : parts.named_parameters()) r.grads[fqn] = whole(p.grad()).clone();
    for (const auto& [fqn, m] : nn::match_modules(*parts.model, "layers.0.mlp.router"))
      r.tokens_per_expert = dynamic_cast<nn::TokenChoiceTopKRouter&>(*m).tokens_per_expert.clone();
  });
  return runs;
}

const std::string kLlama = "model: {family: llama, vocab: 64, dim: 32, layers: 2, heads: 4, kv_heads: 2, max_seq: 16}";

// FSDP (dp_shard 2) and TP (tp 2) on 2 ranks: checkpointed (or swapped) blocks give bitwise the
// gradients of plain blocks. FSDP: a checkpointed unit gathers once in backward, for the recomputation, and stays
// gathered for the backward after it: as many all-gathers as without checkpointing. TP: the
// recomputation repeats each block's two forward all-reduces (attention's and the MLP's row-parallel
// outputs).
TEST(ActivationCheckpoint, FsdpAndTensorParallelGradientsAreBitwiseAndCollectivesAsPredicted) {
  for (const auto& [dp_shard, tp] : {std::pair<int64_t, int64_t>{2, 1}, {1, 2}}) {
    ParallelDims dims;
    dims.dp_shard = dp_shard;
    dims.tp = tp;
    const std::vector<RankRun> plain = run_recipe(kLlama, dims, CheckpointMode::kNone);
    for (const CheckpointMode mode : {CheckpointMode::kFull, CheckpointMode::kSelective, CheckpointMode::kSwap}) {
      const std::vector<RankRun> got = run_recipe(kLlama, dims, mode);
      const std::string what = (tp > 1 ? std::string("tp 2, ") : std::string("dp_shard 2, ")) +
                               (mode == CheckpointMode::kFull   ? "full"
                                : mode == CheckpointMode::kSwap ? "swap"
                                                                : "selective");
      for (size_t rank = 0; rank < got.size(); ++rank) {
        check_close(got[rank].loss, plain[rank].loss, what + ": loss", true);
        for (const auto& [fqn, grad] : plain[rank].grads)
          check_close(got[rank].grads.at(fqn), grad, what + ": " + fqn, true);
        std::map<std::string, int64_t> want = plain[rank].backward_collectives;
        if (tp > 1) want["all_reduce"] += 2 * 2;  // 2 blocks x (attention + MLP)
        EXPECT_EQ(got[rank].backward_collectives, want) << what << ", rank " << rank;
      }
    }
  }
}

// Qwen3-MoE with expert parallelism (dp_shard 2, ep 2), checkpointed or swapped: the recomputation
// replays each layer's
// routing and its exchange of counts (no top-k, no host read, no all_to_all of counts in backward), the
// balancing counters count the forward once, and gradients are bitwise those without checkpointing.
TEST(ActivationCheckpoint, MoeRoutingIsReplayedUnderExpertParallelism) {
  const std::string yaml =
      "model: {family: qwen3_moe, vocab: 64, dim: 32, layers: 2, heads: 4, kv_heads: 2, max_seq: 16, experts: 4, "
      "top_k: 2, expert_hidden: 16, load_balance_rate: 0.001, aux_loss_coeff: 0.01}";
  ParallelDims dims;
  dims.dp_shard = 2;
  dims.ep = 2;
  const std::vector<RankRun> plain = run_recipe(yaml, dims, CheckpointMode::kNone);
  for (const CheckpointMode mode : {CheckpointMode::kFull, CheckpointMode::kSwap}) {
    const std::vector<RankRun> full = run_recipe(yaml, dims, mode);
    for (size_t rank = 0; rank < full.size(); ++rank) {
      check_close(full[rank].loss, plain[rank].loss, "moe: loss", true);
      for (const auto& [fqn, grad] : plain[rank].grads)
        check_close(full[rank].grads.at(fqn), grad, "moe: " + fqn, true);
      EXPECT_EQ(full[rank].backward_host_syncs, 0);
      EXPECT_EQ(full[rank].backward_topks, 0);
      // Plain backward runs the transposes of the rows' two all_to_alls per layer; the recomputation
      // adds the forward's two (dispatch and combine), not the counts' exchange.
      EXPECT_EQ(full[rank].backward_collectives.at("all_to_all"),
                plain[rank].backward_collectives.at("all_to_all") + 2 * 2);
      ASSERT_TRUE(full[rank].tokens_per_expert.defined());
      check_close(full[rank].tokens_per_expert, plain[rank].tokens_per_expert, "moe: tokens per expert", true);
    }
  }
}

}  // namespace
}  // namespace hp::test
