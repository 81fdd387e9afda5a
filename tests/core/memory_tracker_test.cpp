// MemoryTracker charges a thread's tensor allocations, credits frees, nests, and ignores other
// threads.
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

}  // namespace
}  // namespace hp::test
