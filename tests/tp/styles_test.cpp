// Each parallel style on its own layer type against the same layer on one device (values and
// parameter gradients), including biases and both ways of sharding an embedding.
#include <hp/comm/comm_debug_mode.h>
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

// What a 2-rank layer gives on rank 0: its output, the gradient of its input, and the collectives
// it issued (how many, their bytes, how many on a low-precision wire).
struct LayerRun {
  at::Tensor out, input_grad;
  int64_t collectives = 0, bytes = 0, on_wire = 0;
};

LayerRun run_linear(const ParallelStyle& style) {
  LayerRun result;
  run(2, [&](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    nn::Linear layer(8, 6, /*bias=*/true);
    parallelize_module(layer, mesh, {{"", style}});
    nn::init_parameters(layer, 5);
    const at::Tensor x = kFeatures.clone().requires_grad_(true);
    comm::CommDebugMode comm;
    const at::Tensor out = whole(layer(x));
    (out * out).sum().backward();
    if (g.rank() == 0)
      result = {out.detach(), x.grad(), comm.total(), comm.total_bytes(),
                comm.on_wire("all_reduce") + comm.on_wire("reduce_scatter")};
  });
  return result;
}

// set_reduce_wire: a Rowwise layer's output all_reduce (forward) and a Colwise layer's reduction of
// its input's gradient (backward) carry the format and add in fp32: not the native results, within
// the format's rounding of them (largest difference / largest value at most 1e-2 for bf16, 0.15 for
// fp8), with the same collectives, the one reduction on the wire; the Colwise forward, which
// reduces nothing, stays bitwise.
TEST(ParallelStyles, ReductionsOnALowPrecisionWire) {
  const LayerRun row = run_linear(RowwiseParallel().set_input_layouts(Replicate()));
  const LayerRun col = run_linear(ColwiseParallel().set_output_layouts(Replicate()));
  EXPECT_EQ(row.on_wire + col.on_wire, 0);
  for (comm::WireFormat wire : {comm::WireFormat::kBf16, comm::WireFormat::kFp8E4M3}) {
    const std::string name = comm::to_string(wire);
    const double rtol = wire == comm::WireFormat::kBf16 ? 1e-2 : 0.15;
    const LayerRun row_wire = run_linear(RowwiseParallel().set_input_layouts(Replicate()).set_reduce_wire(wire));
    EXPECT_FALSE(at::equal(row_wire.out, row.out)) << name << ": the Rowwise output was reduced natively";
    check_relative(row_wire.out, row.out, "Rowwise output on " + name, rtol);
    EXPECT_EQ(row_wire.collectives, row.collectives);
    EXPECT_EQ(row_wire.bytes, row.bytes);
    EXPECT_EQ(row_wire.on_wire, 1);
    const LayerRun col_wire = run_linear(ColwiseParallel().set_output_layouts(Replicate()).set_reduce_wire(wire));
    EXPECT_TRUE(at::equal(col_wire.out, col.out)) << name;
    EXPECT_FALSE(at::equal(col_wire.input_grad, col.input_grad)) << name << ": the input gradient was reduced natively";
    check_relative(col_wire.input_grad, col.input_grad, "Colwise input gradient on " + name, rtol);
    EXPECT_EQ(col_wire.collectives, col.collectives);
    EXPECT_EQ(col_wire.on_wire, 1);
  }
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
