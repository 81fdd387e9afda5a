// MemoryTracker charges a thread's tensor allocations, credits frees, nests, and ignores other
// threads unless they work for it (ChargeTo); meta trackers count meta tensors.
#include <hp/core/memory_tracker.h>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <thread>

#include "test_util.h"

namespace hp::test {
namespace {

constexpr int64_t kMiB = 1 << 20;

TEST(MemoryTracker, CountsCurrentAndPeakOfThisThread) {
  MemoryTracker outer;
  {
    MemoryTracker inner;
    at::Tensor a = at::empty({kMiB / 4}, at::kFloat);  // 1 MiB
    EXPECT_EQ(inner.current(), kMiB);
    {
      at::Tensor b = at::empty({kMiB / 2}, at::kFloat);  // 2 MiB more, then freed
    }
    EXPECT_EQ(inner.current(), kMiB);
    EXPECT_EQ(inner.peak(), 3 * kMiB);
    inner.reset_peak();
    EXPECT_EQ(inner.peak(), kMiB);
    std::thread([] { at::Tensor elsewhere = at::empty({kMiB}, at::kFloat); }).join();  // another thread
    EXPECT_EQ(inner.peak(), kMiB);
  }
  EXPECT_EQ(outer.current(), 0);
  EXPECT_EQ(outer.peak(), 3 * kMiB);
}

TEST(MemoryTracker, FreesOnOtherThreadsAreCredited) {
  MemoryTracker tracker;
  at::Tensor a = at::empty({kMiB / 4}, at::kFloat);
  std::thread([t = std::move(a)]() mutable { t.reset(); }).join();
  EXPECT_EQ(tracker.current(), 0);
  EXPECT_EQ(tracker.peak(), kMiB);
}

// Raw allocations (ATen's scratch buffers, e.g. inside GELU) are charged, credited when freed, and
// do not abort the process, with or without a tracker on the thread.
TEST(MemoryTracker, RawAllocationsAreCountedAndFreed) {
  MemoryTracker tracker;
  c10::Allocator* cpu = c10::GetCPUAllocator();
  void* charged = cpu->raw_allocate(kMiB);
  EXPECT_EQ(tracker.current(), kMiB);
  std::thread([cpu] { cpu->raw_deallocate(cpu->raw_allocate(kMiB)); }).join();  // uncharged, other thread
  cpu->raw_deallocate(charged);
  EXPECT_EQ(tracker.current(), 0);
  EXPECT_EQ(tracker.peak(), kMiB);
  const at::Tensor x = at::linspace(-3, 3, 4096);
  EXPECT_NEAR(at::gelu(x)[-1].item<float>(), 3.0f * 0.99865f, 1e-4);  // aborted before the fix
}

// A meta tracker counts the bytes meta tensors would take (what a dry run measures), a CPU one
// only host memory, and one of both devices both.
TEST(MemoryTracker, MetaTrackersCountWhatMetaTensorsWouldTake) {
  MemoryTracker cpu, meta(MemoryTracker::kMeta), both(MemoryTracker::kCpuAndMeta);
  {
    const at::Tensor m = at::empty({kMiB / 4}, at::TensorOptions().device(at::kMeta));  // 1 MiB
    const at::Tensor product = at::mm(at::empty({256, 256}, m.options()), at::empty({256, 512}, m.options()));
    const at::Tensor host = at::empty({kMiB / 2}, at::kFloat);  // 2 MiB
    EXPECT_EQ(meta.current(), kMiB + 512 * 1024);
    EXPECT_EQ(cpu.current(), 2 * kMiB);
    EXPECT_EQ(both.current(), 3 * kMiB + 512 * 1024);
  }
  EXPECT_EQ(meta.current(), 0);
  EXPECT_EQ(meta.peak(), kMiB + 256 * 1024 + 512 * 1024 + 512 * 1024);  // the factors lived until the product
  EXPECT_EQ(both.current(), 0);
}

// What another thread allocates under a ChargeTo of this thread's owners is this thread's, and is
// credited back when freed, whichever thread frees it (a group's collective worker).
TEST(MemoryTracker, ChargeToCountsAnotherThreadsWorkAsThisThreads) {
  MemoryTracker tracker;
  const auto owners = MemoryTracker::owners_of_this_thread();
  at::Tensor made;
  std::thread([&] {
    const MemoryTracker::ChargeTo charge(owners);
    made = at::empty({kMiB / 4}, at::kFloat);
  }).join();
  EXPECT_EQ(tracker.current(), kMiB);
  std::thread([] { at::Tensor uncharged = at::empty({kMiB}, at::kFloat); }).join();
  EXPECT_EQ(tracker.peak(), kMiB);
  made.reset();
  EXPECT_EQ(tracker.current(), 0);
  EXPECT_EQ(MemoryTracker::owners_of_this_thread()->size(), 1u);
}

}  // namespace
}  // namespace hp::test
