// Async TP (set_async_tp on ColwiseParallel and RowwiseParallel): a Linear whose sequence-parallel
// gather or reduce-scatter is fused with its matmul, against the same Linear on one device (output,
// the input's gradient, the parameters' gradients), with the fused ops counted in forward and in
// backward; and the plans that cannot be fused, refused.
#include <hp/comm/comm_debug_mode.h>
#include <hp/dtensor/dtensor.h>
#include <hp/nn/init.h>
#include <hp/nn/layers.h>
#include <hp/parallel/checkpoint.h>
#include <hp/parallel/tensor_parallel.h>

#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

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

// Three Linear layers on one input (attention's q/k/v): q(x) * k(x) + v(x), feature by feature,
// so that each rank's piece of the features is its own to compute.
class ThreeOnOneInput : public nn::Module {
 public:
  ThreeOnOneInput()
      : nn::Module("ThreeOnOneInput"),
        q(add_module("q", std::make_shared<nn::Linear>(8, 8, /*bias=*/true))),
        k(add_module("k", std::make_shared<nn::Linear>(8, 8, /*bias=*/false))),
        v(add_module("v", std::make_shared<nn::Linear>(8, 8, /*bias=*/true))) {}
  std::shared_ptr<nn::Linear> q, k, v;
  // k called on another tensor with the same values: q's gather computes all three, k's on the
  // copy again, and v's on the input again (the one held is the copy).
  bool k_on_a_copy = false;
  bool skip_v = false;  // v not called: its output, computed with q's, goes unused

 protected:
  at::Tensor forward(const at::Tensor& x) override {
    const at::Tensor qx = (*q)(x);
    const at::Tensor kx = (*k)(k_on_a_copy ? x.clone() : x);
    return skip_v ? qx * kx : qx * kx + (*v)(x);
  }
};

ParallelizePlan shared_gather_plan() {
  const auto colwise = [] { return ColwiseParallel().set_input_layouts(Shard(1)).set_async_tp(true); };
  return {{"q", colwise()}, {"k", colwise()}, {"v", colwise()}, {"", ShareInputGather({"q", "k", "v"}, Shard(1))}};
}

// The three layers on one device: their output on kInput, and the gradients of the sum of its
// squares (in x.grad() and the parameters').
struct OneDevice {
  std::shared_ptr<ThreeOnOneInput> model = std::make_shared<ThreeOnOneInput>();
  at::Tensor x = kInput.clone().requires_grad_(), output;
};

OneDevice one_device_three_layers() {
  OneDevice one;
  nn::init_parameters(*one.model, 5);
  one.output = (*one.model)(one.x);
  (one.output * one.output).sum().backward();
  return one;
}

// ShareInputGather: one fused gather for the three layers in forward; in backward one fused
// reduce-scatter for the input's gradient and one gather for the weights' (each layer alone: 3 and
// 6); against one device. A backward asked for the input's gradient only, or the weights' only (the
// I and W passes of the zero-bubble schedules), does only its part. A layer called on another
// tensor computes its output again, with the same results.
TEST(AsyncTp, LayersOnOneInputShareItsGather) {
  const OneDevice one = one_device_three_layers();
  const ThreeOnOneInput& reference = *one.model;
  const at::Tensor &x = one.x, &want = one.output;
  for (const bool k_on_a_copy : {false, true})
    for (int tp : {2, 4}) {
      const std::string what = "tp " + std::to_string(tp) + (k_on_a_copy ? ", k on a copy" : "");
      run(tp, [&](const comm::ProcessGroup& g) {
        DeviceMesh mesh = init_device_mesh(g, "cpu", {tp}, {"tp"});
        ThreeOnOneInput model;
        model.k_on_a_copy = k_on_a_copy;
        parallelize_module(model, mesh, shared_gather_plan());
        nn::init_parameters(model, 5);
        const at::Tensor in = x.detach().chunk(tp, 1)[g.rank()].clone().requires_grad_();
        comm::CommDebugMode forward;
        const at::Tensor out = model(DTensor::from_local(in, mesh, {Shard(1)}));
        EXPECT_EQ(forward.count("all_gather_matmul"), k_on_a_copy ? 3 : 1) << what << ": " << forward.str();
        check_close(out, want.detach().chunk(tp, 2)[g.rank()], what + ": output");
        const at::Tensor loss = (out * out).sum();
        std::vector<at::Tensor> weights;
        for (const auto& item : model.named_parameters()) weights.push_back(item.value());
        // The input's gradient alone: one fused reduce-scatter (three where k ran apart), no gather.
        comm::CommDebugMode input_pass;
        const at::Tensor dx = torch::autograd::grad({loss}, {in}, {}, /*retain_graph=*/true)[0];
        EXPECT_EQ(input_pass.count("matmul_reduce_scatter"), k_on_a_copy ? 3 : 1) << what << ": " << input_pass.str();
        EXPECT_EQ(input_pass.count("all_gather_matmul"), 0) << what << ": " << input_pass.str();
        check_close(dx, x.grad().chunk(tp, 1)[g.rank()], what + ": input gradient");
        // The weights' alone: one gather of the input (three where k ran apart: the outputs each
        // gather left untaken get zeros).
        comm::CommDebugMode weight_pass;
        const std::vector<at::Tensor> dws = torch::autograd::grad({loss}, weights);
        EXPECT_EQ(weight_pass.count("all_gather_matmul"), k_on_a_copy ? 3 : 1) << what << ": " << weight_pass.str();
        EXPECT_EQ(weight_pass.count("matmul_reduce_scatter"), 0) << what << ": " << weight_pass.str();
        size_t i = 0;
        for (const auto& item : model.named_parameters())
          check_close(whole(dws[i++]), reference.named_parameters()[item.key()].grad(),
                      what + ": grad of " + item.key());
      });
    }
}

// What one call of the module computed for a layer it did not call goes with the call: the layer
// called later (here on its own, after its weight changed) computes its output anew.
TEST(AsyncTp, ASharedGathersOutputsDoNotOutliveTheCall) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    ThreeOnOneInput model;
    model.skip_v = true;
    parallelize_module(model, mesh, shared_gather_plan());
    nn::init_parameters(model, 5);
    const at::Tensor x = DTensor::from_local(kInput.chunk(2, 1)[g.rank()].clone(), mesh, {Shard(1)});
    comm::CommDebugMode comm;
    model(x);
    {
      at::NoGradGuard no_grad;
      DTensor(model.v->param("weight")).to_local().mul_(2.0f);
    }
    const at::Tensor v = (*model.v)(x);
    EXPECT_EQ(comm.count("all_gather_matmul"), 2) << comm.str();
    const at::Tensor w = DTensor(model.v->param("weight")).to_local().detach();
    const at::Tensor b = DTensor(model.v->param("bias")).to_local().detach();
    check_close(v, at::linear(kInput, w, b), "v after its weight changed");
  });
}

// Checkpointing: a layer checkpointed alone (whose recomputation runs outside a call of the
// module, on a fresh input) gathers for itself, the others still share; the module checkpointed
// (selective: products saved) shares in forward and in its recomputation. Against one device.
TEST(AsyncTp, ASharedGatherUnderCheckpointing) {
  const OneDevice one = one_device_three_layers();
  const ThreeOnOneInput& reference = *one.model;
  const at::Tensor &x = one.x, &want = one.output;
  for (const bool k_alone : {true, false}) {
    const std::string what = k_alone ? "k checkpointed alone" : "the module checkpointed, selective";
    run(2, [&](const comm::ProcessGroup& g) {
      DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
      ThreeOnOneInput model;
      parallelize_module(model, mesh, shared_gather_plan());
      nn::init_parameters(model, 5);
      if (k_alone)
        checkpoint(*model.k);
      else
        checkpoint(model, {default_checkpoint_policy});
      const at::Tensor in = x.detach().chunk(2, 1)[g.rank()].clone().requires_grad_();
      comm::CommDebugMode forward;
      const at::Tensor out = model(DTensor::from_local(in, mesh, {Shard(1)}));
      EXPECT_EQ(forward.count("all_gather_matmul"), k_alone ? 2 : 1) << what << ": " << forward.str();
      check_close(out, want.detach().chunk(2, 2)[g.rank()], what + ": output");
      (out * out).sum().backward();
      check_close(in.grad(), x.grad().chunk(2, 1)[g.rank()], what + ": input gradient");
      for (const auto& item : model.named_parameters())
        check_close(whole(item.value().grad()), reference.named_parameters()[item.key()].grad(),
                    what + ": grad of " + item.key());
    });
  }
}

TEST(AsyncTp, ASharedGatherNeedsFusedColwiseLinearLayers) {
  run(2, [](const comm::ProcessGroup& g) {
    DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"tp"});
    ThreeOnOneInput model;
    expect_error(
        [&] {
          parallelize_module(model, mesh, {{"", ShareInputGather({"q"}, Shard(1))}});
        },
        {"ShareInputGather on ''", "at least two layers, got 1"});
    expect_error(
        [&] {
          parallelize_module(model, mesh, {{"", ShareInputGather({"q", "w"}, Shard(1))}});
        },
        "'w' is not a layer under it");
    expect_error(
        [&] {
          parallelize_module(model, mesh, {{"", ShareInputGather({"q", "k"}, Replicate())}});
        },
        "sharded on the sequence dim");
    expect_error(
        [&] {
          parallelize_module(model, mesh,
                             {{"q", ColwiseParallel().set_input_layouts(Shard(1))},
                              {"k", ColwiseParallel().set_input_layouts(Shard(1)).set_async_tp(true)},
                              {"", ShareInputGather({"q", "k"}, Shard(1))}});
        },
        "apply ColwiseParallel().set_input_layouts(S(1)).set_async_tp(true) to 'q'");
    // A weight that is not its Colwise piece when the first layer is called (an FSDP unit around
    // one layer alone leaves the others' sharded).
    ThreeOnOneInput apart;
    parallelize_module(apart, mesh, shared_gather_plan());
    nn::init_parameters(apart, 5);
    apart.k->set_param("weight", at::zeros({8, 8}));
    expect_error([&] { apart(DTensor::from_local(kInput.chunk(2, 1)[g.rank()], mesh, {Shard(1)})); },
                 {"ShareInputGather on ''", "'k's weight is not the Colwise piece", "when 'q' is called"});
  });
}

}  // namespace
}  // namespace hp::test
