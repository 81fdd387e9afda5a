// OpTimer: every op a region runs, timed once (an op's inner ops are part of it), by op and by
// class; forward and backward alike; hp's kernels as their own class.
#include <ATen/ATen.h>
#include <hp/core/op_timer.h>

#include <chrono>

#include "test_util.h"

namespace hp::test {
namespace {

TEST(OpTimer, TimesEveryOpOnceByOpAndClass) {
  const at::Tensor x = at::randn({256, 512});
  const at::Tensor w = at::randn({512, 512}).requires_grad_();
  OpTimer timer;
  const auto start = std::chrono::steady_clock::now();
  {
    DispatchModeGuard on(timer);
    at::matmul(x, w).exp().sum().backward();
  }
  const double region = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto& ops = timer.by_op();
  ASSERT_TRUE(ops.count("aten::mm")) << "no matmul seen";
  EXPECT_EQ(ops.at("aten::mm").calls, 2);  // forward, and the weight's gradient
  EXPECT_GT(ops.at("aten::mm").seconds, 0.0);
  EXPECT_EQ(ops.at("aten::exp").calls, 1);
  const auto classes = timer.by_class();
  EXPECT_DOUBLE_EQ(classes.at("matmul").seconds, ops.at("aten::mm").seconds);
  double sum = 0.0;
  for (const auto& [name, t] : classes) sum += t.seconds;
  EXPECT_NEAR(sum, timer.total_seconds(), 1e-12);
  EXPECT_LE(timer.total_seconds(), region);  // nothing counted twice
  EXPECT_EQ(classes.at("matmul").calls, 2);
  EXPECT_GT(classes.at("elementwise").calls, 0);
}

// Set as the thread's kernel observer, it times hp's kernels as ops of their own class.
TEST(OpTimer, TimesHpKernelsAsTheirOwnClass) {
  OpTimer timer;
  {
    KernelObserverGuard observe(&timer);
    for (int i = 0; i < 2; ++i) run_kernel("test_kernel", 64, [] {});
  }
  run_kernel("test_kernel", 64, [] {});  // no observer: not seen
  ASSERT_TRUE(timer.by_op().count("hp::test_kernel"));
  EXPECT_EQ(timer.by_op().at("hp::test_kernel").calls, 2);
  EXPECT_EQ(timer.by_class().at("hp kernel").calls, 2);
  EXPECT_EQ(op_class("hp::swiglu_forward"), "hp kernel");
}

TEST(OpTimer, ClassesByBaseName) {
  EXPECT_EQ(op_class("aten::addmm"), "matmul");
  EXPECT_EQ(op_class("aten::add_.Tensor"), "elementwise");
  EXPECT_EQ(op_class("aten::_foreach_mul_.List"), "elementwise");
  EXPECT_EQ(op_class("aten::sum.dim_IntList"), "reduction");
  EXPECT_EQ(op_class("aten::_to_copy"), "copy and cast");
  EXPECT_EQ(op_class("aten::copy_"), "copy and cast");
  EXPECT_EQ(op_class("aten::embedding_dense_backward"), "indexing");
  EXPECT_EQ(op_class("aten::zero_"), "allocation and fill");
  EXPECT_EQ(op_class("aten::view"), "view");
  EXPECT_EQ(op_class("aten::some_new_op"), "other");
}

}  // namespace
}  // namespace hp::test
