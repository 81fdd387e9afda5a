// Each parallel style on its own layer type against the same layer on one device (values and
// parameter gradients), including biases and both ways of sharding an embedding.
#include <hp/dtensor/dtensor.h>
#include <hp/nn/init.h>
#include <hp/nn/layers.h>
#include <hp/parallel/tensor_parallel.h>

#include "test_util.h"

namespace hp::test {
namespace {

// Runs `make()` on one device and under `style` on `tp` ranks with input `x`; compares the output
// (gathered as `gather` says) and every parameter gradient.
void check_style(const std::function<std::shared_ptr<nn::Module>()>& make, const ParallelStyle& style,
                 const at::Tensor& x, int tp, const std::string& what) {
  auto reference = make();
  nn::init_parameters(*reference, 5);
  const at::Tensor want = (*reference)(x);
  (want * want).sum().backward();
  run(tp, [&](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {tp}, {"tp"});
    auto module = make();
    parallelize_module(*module, mesh, {{"", style}});
    nn::init_parameters(*module, 5);
    const at::Tensor out = (*module)(x);
    const at::Tensor got = whole(out);
    check_close(got, want.detach(), what + ": output");
    (out * out).sum().backward();
    for (const auto& item : reference->named_parameters())
      check_close(whole(module->named_parameters()[item.key()].grad()), item.value().grad(),
                  what + ": grad of " + item.key());
  });
}

const at::Tensor kFeatures = at::randn({3, 4, 8}, at::make_generator<at::CPUGeneratorImpl>(1));
const at::Tensor kTokens =
    at::randint(0, 12, {3, 5}, at::make_generator<at::CPUGeneratorImpl>(2), at::TensorOptions().dtype(at::kLong));

auto linear() {
  return [] { return std::static_pointer_cast<nn::Module>(std::make_shared<nn::Linear>(8, 6, /*bias=*/true)); };
}
auto embedding() {
  return [] { return std::static_pointer_cast<nn::Module>(std::make_shared<nn::Embedding>(12, 8)); };
}

TEST(ParallelStyles, ColwiseLinearWithBias) {
  check_style(linear(), ColwiseParallel().set_output_layouts(Replicate()), kFeatures, 2, "colwise linear");
}

TEST(ParallelStyles, RowwiseLinearWithBiasFromReplicatedInput) {
  check_style(linear(), RowwiseParallel().set_input_layouts(Replicate()), kFeatures, 2, "rowwise linear");
}

TEST(ParallelStyles, EmbeddingRowwiseOverTheVocabulary) {
  check_style(embedding(), RowwiseParallel(), kTokens, 4, "rowwise embedding");
}

TEST(ParallelStyles, EmbeddingColwiseOverFeatures) {
  check_style(embedding(), ColwiseParallel().set_output_layouts(Replicate()), kTokens, 4, "colwise embedding");
}

TEST(ParallelStyles, RowwiseInputOfTheWrongWidthIsAnError) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    nn::Linear layer(8, 6);
    parallelize_module(layer, mesh, {{"", RowwiseParallel()}});
    nn::init_parameters(layer, 5);
    expect_error([&] { layer(at::ones({2, 8})); }, {"last dim is 8", "piece of 8 features", "is 4"});
  });
}

}  // namespace
}  // namespace hp::test
