// hp::nn::Module: hooks, parameters by FQN, pattern lookup, deferred and sharding-invariant init,
// and the errors of bad plans.
#include <hp/core/memory_tracker.h>
#include <hp/dtensor/dtensor.h>
#include <hp/nn/init.h>
#include <hp/nn/layers.h>
#include <hp/parallel/tensor_parallel.h>

#include "test_util.h"
#include "tp/llama_model.h"
#include "tp/llama_plan.h"

namespace hp::test {
namespace {

TEST(NnModule, HooksRunInOrderAndCanReplaceInputsAndOutputs) {
  nn::Linear linear(3, 2);
  nn::init_parameters(linear, 7);
  std::vector<std::string> seen;
  linear.register_forward_pre_hook([&](nn::Module&, nn::Inputs& in) { seen.push_back("pre1"), in[0] = in[0] * 2.0; });
  const nn::HookHandle second =
      linear.register_forward_pre_hook([&](nn::Module&, nn::Inputs&) { seen.push_back("pre2"); });
  linear.register_forward_hook([&](nn::Module&, const nn::Inputs& in, at::Tensor& out) {
    seen.push_back("post");
    EXPECT_TRUE(at::equal(in[0], at::full({4, 3}, 2.0)));  // hooks see the replaced input
    out = out + 1.0;
  });
  const at::Tensor x = at::ones({4, 3});
  const at::Tensor want = at::linear(x * 2.0, linear.param("weight"), linear.param("bias")) + 1.0;
  check_close(linear(x), want, "hooked linear", /*bitwise=*/true);
  EXPECT_EQ(seen, (std::vector<std::string>{"pre1", "pre2", "post"}));
  linear.remove_hook(second);
  seen.clear();
  linear(x);
  EXPECT_EQ(seen, (std::vector<std::string>{"pre1", "post"}));
  expect_error([&] { linear.remove_hook(second); }, "no hook with id");
}

TEST(NnModule, ParametersByFqnAndPatterns) {
  Llama model(LlamaConfig{});
  std::vector<std::string> names;
  for (auto& [fqn, m] : nn::match_modules(model, "layers.*.attn.q_proj")) names.push_back(fqn);
  EXPECT_EQ(names, (std::vector<std::string>{"layers.0.attn.q_proj", "layers.1.attn.q_proj"}));
  EXPECT_EQ(nn::match_modules(model, "layers.*").size(), 2u);
  EXPECT_TRUE(nn::match_modules(model, "layers.*.q_proj").empty());  // '*' is one segment
  EXPECT_EQ(&nn::find_module(model, "layers.1.mlp.down"),
            model.layers->operator[](1).named_children()[3].value().get()->named_children()[2].value().get());
  expect_error([&] { nn::find_module(model, "layers.1.mlp.nope"); }, {"no hp::nn module 'nope'", "layers.1.mlp"});

  nn::init_parameters(model, 1);
  const at::Tensor replacement = at::zeros({LlamaConfig{}.dim});
  nn::replace_parameter(model, "layers.0.attn_norm.weight", replacement);
  EXPECT_TRUE(model.named_parameters()["layers.0.attn_norm.weight"].is_same(replacement));  // what optimizers see
  expect_error([&] { nn::replace_parameter(model, "norm.weight", at::zeros({3})); }, {"norm.weight", "shape"});
  expect_error([&] { nn::replace_parameter(model, "norm.bias", at::zeros({3})); }, "has no parameter 'bias'");
}

// The layers share one pair of rotary tables: a model of 8 layers and one of 1 take the same host
// memory to build (its parameters have none before init), at most one pair of tables, and the
// tables go with the last model.
TEST(NnModule, LlamaLayersShareTheirRotaryTables) {
  LlamaConfig c;
  c.max_seq = 4096;
  const int64_t tables = 2 * c.max_seq * c.head_size() * static_cast<int64_t>(sizeof(float));
  for (const int64_t layers : {int64_t{1}, int64_t{8}}) {
    c.layers = layers;
    MemoryTracker memory;
    {
      const Llama model(c);
      EXPECT_LE(memory.current(), tables + 64 * 1024) << layers << " layers";
    }
    EXPECT_LE(memory.current(), 1024) << "the tables outlived the last model holding them";
  }
}

TEST(NnModule, RunningBeforeInitIsAClearError) {
  nn::Linear linear(3, 2);
  EXPECT_TRUE(linear.param("weight").is_meta());  // deferred: no storage until init_parameters
  expect_error([&] { linear(at::ones({1, 3})); }, {"weight", "init_parameters"});
}

TEST(NnModule, DropoutIsSeededAndReproducible) {
  auto draw = [](uint64_t seed) {
    nn::Dropout dropout(0.5);
    nn::init_parameters(dropout, seed);
    return std::make_pair(dropout(at::ones({64})), dropout(at::ones({64})));
  };
  const auto [a1, a2] = draw(3);
  const auto [b1, b2] = draw(3);
  EXPECT_TRUE(at::equal(a1, b1) && at::equal(a2, b2));  // same seed, same masks
  EXPECT_FALSE(at::equal(a1, a2));                      // each call draws a new mask
  EXPECT_TRUE(at::logical_or(a1.eq(0), a1.eq(2)).all().item<bool>());
  nn::Dropout eval_mode(0.5);
  eval_mode.eval();
  EXPECT_TRUE(at::equal(eval_mode(at::ones({4})), at::ones({4})));
}

// Every local shard equals the matching slice of a single-device init with the same seed.
TEST(DeferredInit, ShardsEqualSlicesOfSingleDeviceInit) {
  Llama reference(LlamaConfig{});
  nn::init_parameters(reference, 99);
  const auto want = reference.named_parameters();
  for (int tp : {1, 2, 4}) {
    run(tp, [&](const comm::ProcessGroup& g) {
      DeviceMesh mesh = init_device_mesh(g, "cpu", {tp}, {"tp"});
      Llama model(LlamaConfig{});
      parallelize_module(model, mesh, llama_tp_plan({true, true}));
      for (const auto& item : model.named_parameters()) EXPECT_TRUE(item.value().is_meta()) << item.key();
      nn::init_parameters(model, 99);
      for (const auto& item : model.named_parameters()) {
        const DTensor p(item.value());
        const at::Tensor slice = DTensor(distribute_tensor(want[item.key()], mesh, p.placements())).to_local();
        check_close(p.to_local(), slice, item.key() + " at TP=" + std::to_string(tp), /*bitwise=*/true);
      }
    });
  }
}

TEST(ParallelizeModule, BadPlansFailBeforeChangingAnything) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    Llama model(LlamaConfig{});
    expect_error(
        [&] {
          parallelize_module(model, mesh,
                             {{"layers.*.attn.q_proj", ColwiseParallel()}, {"layers.*.atn.o_proj", RowwiseParallel()}});
        },
        {"'layers.*.atn.o_proj'", "matches no module"});
    expect_error(
        [&] {
          parallelize_module(model, mesh, {{"layers.0.attn", ColwiseParallel()}});
        },
        {"ColwiseParallel on 'layers.0.attn'", "Attention", "supports Linear and Embedding"});
    expect_error([&] { parallelize_module(model, mesh, {{"layers.*.attn_norm", RowwiseParallel()}}); }, "RMSNorm");
    expect_error([&] { parallelize_module(model, mesh, {{"layers.0.attn", SequenceParallel()}}); }, "supports RMSNorm");
    // Nothing above touched the model: every parameter is still a plain (deferred) tensor.
    for (const auto& item : model.named_parameters()) EXPECT_FALSE(is_dtensor(item.value())) << item.key();

    LlamaConfig odd;
    odd.vocab = 63;
    Llama uneven(odd);
    expect_error(
        [&] {
          parallelize_module(uneven, mesh, {{"output", ColwiseParallel()}});
        },
        {"output.weight dim 0", "63", "does not split evenly over 2"});
    DeviceMesh square = init_device_mesh(g, "cpu", {1, 2}, {"dp", "tp"});
    expect_error([&] { parallelize_module(model, square, {{"output", ColwiseParallel()}}); }, "take a 1-D mesh");
  });
}

}  // namespace
}  // namespace hp::test
