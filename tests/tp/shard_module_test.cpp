// shard_module: per-parameter placements on a 2-D mesh, input and output plans, against the same
// model on one device; bad plans fail before anything changes.
#include <hp/dtensor/dtensor.h>
#include <hp/nn/init.h>
#include <hp/nn/layers.h>
#include <hp/parallel/shard_module.h>

#include "test_util.h"

namespace hp::test {
namespace {

class TwoLayers : public nn::Module {
 public:
  TwoLayers()
      : nn::Module("TwoLayers"),
        fc1(add_module("fc1", std::make_shared<nn::Linear>(6, 8))),
        fc2(add_module("fc2", std::make_shared<nn::Linear>(8, 5))) {}
  std::shared_ptr<nn::Linear> fc1, fc2;

 protected:
  at::Tensor forward(const at::Tensor& x) override { return (*fc2)(at::relu((*fc1)(x))); }
};

at::Tensor input() { return at::randn({7, 6}, at::make_generator<at::CPUGeneratorImpl>(3)); }

// Runs the sharded model on input() and checks output and parameter gradients (loss = sum of
// squared outputs) against the single-device `reference`, whose output was `want` and whose
// backward already ran. Returns the output.
at::Tensor expect_matches(TwoLayers& model, TwoLayers& reference, const at::Tensor& want) {
  const at::Tensor out = model(input());
  check_close(DTensor(out).full_tensor(), want.detach(), "output");
  (out * out).sum().backward();
  for (const auto& item : reference.named_parameters())
    check_close(DTensor(model.named_parameters()[item.key()].grad()).full_tensor(), item.value().grad(),
                "grad of " + item.key());
  return out;
}

ShardingPlan megatron_style_plan() {
  ShardingPlan plan;
  plan.plan = {{"fc1.*", {Replicate(), Shard(0)}}, {"fc2.weight", {Replicate(), Shard(1)}}};
  plan.input_plan = {{"", {Placements{Shard(0), Replicate()}}}};  // batch over dp (7 rows: uneven)
  plan.output_plan = {{"", {Replicate(), Replicate()}}};
  return plan;
}

TEST(ShardModule, TwoDimensionalPlanMatchesSingleDevice) {
  TwoLayers reference;
  nn::init_parameters(reference, 11);
  const at::Tensor want = reference(input());
  (want * want).sum().backward();

  run(4, [&](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2, 2}, {"dp", "tp"});
    TwoLayers model;
    shard_module(model, mesh, megatron_style_plan());
    nn::init_parameters(model, 11);
    EXPECT_EQ(DTensor(model.fc1->param("bias")).placements(), (Placements{Replicate(), Shard(0)}));
    EXPECT_EQ(DTensor(model.fc2->param("bias")).placements(), (Placements{Replicate(), Replicate()}));  // unplanned

    EXPECT_EQ(DTensor(expect_matches(model, reference, want)).placements(), (Placements{Replicate(), Replicate()}));
  });
}

// 2-D tensor parallelism: each weight split over both mesh dims (output features over one, input
// features over the other), the input's features split to match; the partial products are
// reduced by the DTensor rules.
TEST(ShardModule, TwoDimensionalTensorParallelMatchesSingleDevice) {
  TwoLayers reference;
  nn::init_parameters(reference, 12);
  const at::Tensor want = reference(input());
  (want * want).sum().backward();

  run(4, [&](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2, 2}, {"a", "b"});
    TwoLayers model;
    ShardingPlan plan;
    plan.plan = {{"fc1.weight", {Shard(0), Shard(1)}},
                 {"fc1.bias", {Shard(0), Replicate()}},
                 {"fc2.weight", {Shard(1), Shard(0)}},
                 {"fc2.bias", {Replicate(), Shard(0)}}};
    plan.input_plan = {{"", {Placements{Replicate(), Shard(1)}}}};  // features split like fc1's inputs
    plan.output_plan = {{"", {Replicate(), Replicate()}}};
    shard_module(model, mesh, plan);
    nn::init_parameters(model, 12);
    const auto coordinate = *mesh.get_coordinate();  // each rank holds one block of each weight
    EXPECT_EQ(DTensor(model.fc1->param("weight")).to_local().sizes(), (std::vector<int64_t>{4, 3}));
    EXPECT_EQ(DTensor(model.fc2->param("weight")).to_local().sizes(),
              (std::vector<int64_t>{coordinate[1] == 0 ? 3 : 2, 4}));
    expect_matches(model, reference, want);
  });
}

TEST(ShardModule, BadPlansAreClearErrors) {
  run(4, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2, 2}, {"dp", "tp"});
    TwoLayers model;
    ShardingPlan unmatched = megatron_style_plan();
    unmatched.plan.push_back({"fc3.weight", {Replicate(), Shard(0)}});
    expect_error([&] { shard_module(model, mesh, unmatched); }, "'fc3.weight' matches no parameter");
    ShardingPlan short_placements;
    short_placements.plan = {{"fc1.weight", {Shard(0)}}};
    expect_error([&] { shard_module(model, mesh, short_placements); }, {"fc1.weight has 1 placements", "2 dims"});
    ShardingPlan out_of_range;
    out_of_range.plan = {{"fc1.bias", {Replicate(), Shard(1)}}};
    expect_error([&] { shard_module(model, mesh, out_of_range); }, {"fc1.bias has 1 dims", "S(1)"});
    ShardingPlan no_module;
    no_module.output_plan = {{"fc9", {Replicate(), Replicate()}}};
    expect_error([&] { shard_module(model, mesh, no_module); }, "output_plan pattern 'fc9' matches no module");
    for (const auto& item : model.named_parameters()) EXPECT_FALSE(is_dtensor(item.value())) << item.key();
  });
}

}  // namespace
}  // namespace hp::test
