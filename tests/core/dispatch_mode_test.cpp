// Dispatch modes see every ATen op below autograd and below DTensor, nest like PyTorch's
// TorchDispatchMode, can replace an op's result, and cost nothing once their guard ends.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <hp/core/dispatch_mode.h>
#include <hp/core/op_counter.h>

#include "test_util.h"

namespace hp::test {
namespace {

TEST(DispatchMode, CountsForwardAndBackwardOpsAndMatmulFlops) {
  const at::Tensor x = at::randn({8, 16});
  const at::Tensor w = at::randn({4, 16}).requires_grad_();
  const at::Tensor b = at::randn({4}).requires_grad_();
  OpCounter forward, backward;
  at::Tensor loss;
  {
    DispatchModeGuard on(forward);
    loss = at::linear(x, w, b).sum();  // linear decomposes into t and addmm
  }
  EXPECT_EQ(forward.count("aten::addmm"), 1);
  EXPECT_EQ(forward.matmuls(), 1);
  EXPECT_EQ(forward.matmul_flops(), 2 * 8 * 16 * 4);
  {
    DispatchModeGuard on(backward);
    loss.backward();
  }
  // x needs no gradient: only the weight's product (grad^T x) runs; the bias's is a sum.
  EXPECT_EQ(backward.count("aten::mm"), 1) << "backward ops: " << backward.counts().size();
  EXPECT_EQ(backward.matmul_flops(), 2 * 4 * 8 * 16);
  EXPECT_EQ(backward.count("aten::addmm"), 0);

  // With the guard gone the key is in no key set: nothing more is counted, and this thread's ops
  // do not pass through the mode kernel at all.
  at::mm(x, w.detach().t());
  EXPECT_EQ(forward.count("aten::mm"), 0);
  const c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
  EXPECT_FALSE(local.included_.has_backend(c10::BackendComponent::PrivateUse2Bit));
  EXPECT_FALSE(local.excluded_.has_backend(c10::BackendComponent::PrivateUse2Bit));
}

// A mode that replaces aten::mul's result (by a + b) and records what the ops it runs look like.
struct MulToAdd : DispatchMode {
  int64_t replaced = 0;
  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override {
    if (op_name(op) != "aten::mul.Tensor") return run_below(op, keys, stack);
    const at::Tensor a = (*stack)[stack->size() - 2].toTensor(), b = (*stack)[stack->size() - 1].toTensor();
    torch::jit::drop(*stack, 2);
    stack->emplace_back(at::add(a, b));  // run from inside: seen by the modes pushed before this one
    ++replaced;
  }
};

TEST(DispatchMode, ModesNestAndOneCanReplaceAResultBelowAutograd) {
  OpCounter outer;
  MulToAdd inner;
  const at::Tensor a = at::full({3}, 2.0).requires_grad_(), b = at::full({3}, 5.0);
  at::Tensor y;
  {
    DispatchModeGuard first(outer);
    DispatchModeGuard second(inner);
    y = at::mul(a, b);
  }
  EXPECT_TRUE(at::equal(y, at::full({3}, 7.0)));  // the replaced value
  EXPECT_EQ(inner.replaced, 1);
  // The outer mode saw the add the inner one ran, not the mul it replaced.
  EXPECT_EQ(outer.count("aten::add.Tensor"), 1);
  EXPECT_EQ(outer.count("aten::mul.Tensor"), 0);
  // Autograd recorded mul above the modes: its backward is mul's (grad * b), whatever ran below.
  y.sum().backward();
  EXPECT_TRUE(at::equal(a.grad(), b));
}

// Counts the ops that get a meta tensor.
struct MetaOps : DispatchMode {
  int64_t seen = 0;
  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override {
    const size_t n = op.schema().arguments().size();
    for (size_t i = stack->size() - n; i < stack->size(); ++i)
      if ((*stack)[i].isTensor() && (*stack)[i].toTensor().defined() && (*stack)[i].toTensor().is_meta()) ++seen;
    run_below(op, keys, stack);
  }
};

TEST(DispatchMode, SeesTheLocalOpsOfDTensorsNotTheirShapeInference) {
  run(2, [](const comm::ProcessGroup& g) {
    const DeviceMesh mesh = init_device_mesh(g, "cpu", {2}, {"x"});
    // Shapes no other test uses: DTensor caches its decisions, and this one must be made here.
    const at::Tensor a = distribute_tensor(at::randn({6, 11}), mesh, {Shard(0)});
    const at::Tensor b = distribute_tensor(at::randn({11, 3}), mesh, {Replicate()});
    OpCounter counter;
    MetaOps meta;
    at::Tensor c;
    {
      DispatchModeGuard count(counter);
      DispatchModeGuard watch(meta);
      c = at::mm(a, b);  // the first mm of these placements: DTensor infers shapes on meta tensors
    }
    HP_CHECK(is_dtensor(c), "mm of DTensors is a DTensor");
    // One local product of this rank's [3, 11] rows by [11, 3], nothing on meta tensors.
    HP_CHECK(counter.count("aten::mm") == 1, "local mm calls: ", counter.count("aten::mm"));
    HP_CHECK(counter.matmul_flops() == 2 * 3 * 11 * 3, "local flops: ", counter.matmul_flops());
    HP_CHECK(meta.seen == 0, "the mode saw ", meta.seen, " ops on meta tensors");
  });
}

TEST(DispatchMode, AGuardCannotBePushedFromInsideADispatch) {
  struct Pusher : DispatchMode {
    OpCounter other;
    bool refused = false;
    void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override {
      try {
        DispatchModeGuard nested(other);
      } catch (const Error&) {
        refused = true;
      }
      run_below(op, keys, stack);
    }
  } pusher;
  {
    DispatchModeGuard on(pusher);
    at::relu(at::ones({2}));
  }
  EXPECT_TRUE(pusher.refused);
}

}  // namespace
}  // namespace hp::test
