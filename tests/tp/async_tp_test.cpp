// Async TP (set_async_tp on ColwiseParallel and RowwiseParallel): a Linear whose sequence-parallel
// gather or reduce-scatter is fused with its matmul, against the same Linear on one device (output,
// the input's gradient, the parameters' gradients), with the fused ops counted in forward and in
// backward; and the plans that cannot be fused, refused.
#include <hp/comm/comm_debug_mode.h>
#include <hp/dtensor/dtensor.h>
#include <hp/nn/init.h>
#include <hp/nn/layers.h>
#include <hp/parallel/tensor_parallel.h>

#include <map>

#include "test_util.h"

namespace hp::test {
namespace {

// [batch 3, sequence 8, features 8]: the sequence splits over 2 and 4 ranks.
const at::Tensor kInput = at::randn({3, 8, 8}, at::make_generator<at::CPUGeneratorImpl>(3));

struct Reference {
  at::Tensor output, input_grad;
  std::map<std::string, at::Tensor> grads;
};

Reference one_device() {
  nn::Linear linear(8, 8, /*bias=*/true);
  nn::init_parameters(linear, 5);
  const at::Tensor x = kInput.clone().requires_grad_();
  const at::Tensor y = linear(x);
  (y * y).sum().backward();
  Reference r{y.detach(), x.grad(), {}};
  for (const auto& item : linear.named_parameters()) r.grads[item.key()] = item.value().grad();
  return r;
}

// `style` on tp ranks, each given its sequence piece of the input (input_sharded) or all of it, and
// handing on its piece of the output along `output_dim`; each rank's loss is the sum of its
// piece's squares, so that the ranks' losses add up to one device's. The fused ops expected in
// forward and in backward are counted.
using Counts = std::map<std::string, int64_t>;

void check_async(const ParallelStyle& style, int tp, bool input_sharded, int64_t output_dim, const Counts& forward_ops,
                 const Counts& backward_ops, const std::string& what) {
  const Reference want = one_device();
  run(tp, [&](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {tp}, {"tp"});
    nn::Linear linear(8, 8, /*bias=*/true);
    parallelize_module(linear, mesh, {{"", style}});
    nn::init_parameters(linear, 5);
    const at::Tensor x = (input_sharded ? kInput.chunk(tp, 1)[g.rank()] : kInput).clone().requires_grad_();
    comm::CommDebugMode forward;
    const at::Tensor out = linear(x);
    for (const auto& [op, count] : forward_ops) EXPECT_EQ(forward.count(op), count) << what << ": " << forward.str();
    check_close(out, want.output.chunk(tp, output_dim)[g.rank()], what + ": output");
    comm::CommDebugMode backward;
    (out * out).sum().backward();
    for (const auto& [op, count] : backward_ops) EXPECT_EQ(backward.count(op), count) << what << ": " << backward.str();
    const at::Tensor want_input_grad = input_sharded ? want.input_grad.chunk(tp, 1)[g.rank()] : want.input_grad;
    check_close(whole(x.grad()), want_input_grad, what + ": input gradient");
    for (const auto& [name, grad] : want.grads)
      check_close(whole(linear.named_parameters()[name].grad()), grad, what + ": grad of " + name);
  });
}

TEST(AsyncTp, ColwiseGathersTheSequenceFusedWithItsMatmul) {
  for (int tp : {2, 4})
    check_async(ColwiseParallel().set_input_layouts(Shard(1)).set_async_tp(true), tp, /*input_sharded=*/true,
                /*output_dim=*/2, {{"all_gather_matmul", 1}},
                // dx fused, and the input gathered again for dw
                {{"matmul_reduce_scatter", 1}, {"all_gather_matmul", 1}, {"reduce_scatter", 0}},
                "colwise at tp " + std::to_string(tp));
}

TEST(AsyncTp, RowwiseReduceScattersTheSequenceFusedWithItsMatmul) {
  for (int tp : {2, 4})
    check_async(RowwiseParallel().set_input_layouts(Replicate()).set_output_layouts(Shard(1)).set_async_tp(true), tp,
                /*input_sharded=*/false, /*output_dim=*/1, {{"matmul_reduce_scatter", 1}, {"reduce_scatter", 0}},
                {{"all_gather_matmul", 1}, {"matmul_reduce_scatter", 0}}, "rowwise at tp " + std::to_string(tp));
}

// The backward needs the layer's input as it was: an in-place change after the forward is an error,
// as autograd's own saved tensors make it.
TEST(AsyncTp, AnInputChangedInPlaceAfterTheForwardIsAnError) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    nn::Linear colwise(8, 8), rowwise(8, 8);
    parallelize_module(colwise, mesh, {{"", ColwiseParallel().set_input_layouts(Shard(1)).set_async_tp(true)}});
    parallelize_module(rowwise, mesh, {{"", RowwiseParallel().set_output_layouts(Shard(1)).set_async_tp(true)}});
    nn::init_parameters(colwise, 5);
    nn::init_parameters(rowwise, 5);
    const at::Tensor leaf = kInput.chunk(2, 1)[g.rank()].clone().requires_grad_();
    const at::Tensor h = leaf * 1.0f;
    const at::Tensor out = colwise(h);
    h.detach().add_(1.0f);
    expect_error([&] { out.sum().backward(); }, {"AllGatherLinearBackward", "modified in place after the forward"});
    const at::Tensor features = kInput.narrow(2, 0, 4).clone().requires_grad_() * 1.0f;  // this rank's half
    const at::Tensor reduced = rowwise(features);
    features.detach().mul_(2.0f);
    expect_error([&] { reduced.sum().backward(); },
                 {"LinearReduceScatterBackward", "modified in place after the forward"});
  });
}

TEST(AsyncTp, PlansThatCannotBeFusedAreRefused) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    nn::Linear linear(8, 6);
    nn::Embedding embedding(12, 8);
    expect_error(
        [&] {
          parallelize_module(linear, mesh, {{"", ColwiseParallel().set_async_tp(true)}});
        },
        {"ColwiseParallel on ''", "input sharded on the sequence dim", "got R"});
    expect_error(
        [&] {
          parallelize_module(linear, mesh, {{"", RowwiseParallel().set_async_tp(true)}});
        },
        "output sharded on the sequence dim");
    expect_error(
        [&] {
          parallelize_module(embedding, mesh,
                             {{"", RowwiseParallel().set_output_layouts(Shard(1)).set_async_tp(true)}});
        },
        "fuses a Linear's matmul");
    expect_error(
        [&] {
          parallelize_module(linear, mesh,
                             {{"", RowwiseParallel()
                                       .set_output_layouts(Shard(1))
                                       .set_reduce_wire(comm::WireFormat::kBf16)
                                       .set_async_tp(true)}});
        },
        "not combined with set_reduce_wire");
  });
}

// A sequence that does not split evenly over the ranks (a prompt being generated) runs unfused,
// with the same results, forward and backward.
TEST(AsyncTp, ASequenceThatDoesNotSplitEvenlyRunsUnfused) {
  nn::Linear reference(8, 8, /*bias=*/true);
  nn::init_parameters(reference, 5);
  const at::Tensor x = kInput.narrow(1, 0, 3).clone().requires_grad_();
  const at::Tensor want = reference(x);
  (want * want).sum().backward();
  const auto check = [&](const ParallelStyle& style, bool input_sharded, int64_t output_dim, const std::string& what) {
    run(2, [&](const comm::ProcessGroup& g) {
      DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
      nn::Linear linear(8, 8, /*bias=*/true);
      parallelize_module(linear, mesh, {{"", style}});
      nn::init_parameters(linear, 5);
      // Pieces of 2 and 1 positions, or all 3.
      const at::Tensor in = (input_sharded ? x.detach().chunk(2, 1)[g.rank()] : x.detach()).clone().requires_grad_();
      comm::CommDebugMode comm;
      const at::Tensor out = linear(input_sharded ? DTensor::from_local(in, mesh, {Shard(1)}) : in);
      check_close(out, want.detach().chunk(2, output_dim)[g.rank()], what + ": output");
      (out * out).sum().backward();
      EXPECT_EQ(comm.count("all_gather_matmul") + comm.count("matmul_reduce_scatter"), 0) << what << ": " << comm.str();
      check_close(in.grad(), input_sharded ? x.grad().chunk(2, 1)[g.rank()] : x.grad(), what + ": input gradient");
      for (const auto& item : reference.named_parameters())
        check_close(whole(linear.named_parameters()[item.key()].grad()), item.value().grad(),
                    what + ": grad of " + item.key());
    });
  };
  check(ColwiseParallel().set_input_layouts(Shard(1)).set_async_tp(true), /*input_sharded=*/true, 2, "colwise");
  check(RowwiseParallel().set_input_layouts(Replicate()).set_output_layouts(Shard(1)).set_async_tp(true),
        /*input_sharded=*/false, 1, "rowwise");
}

}  // namespace
}  // namespace hp::test
