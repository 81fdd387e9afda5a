// Symmetric memory (hp/comm/symmetric_memory.h): one-sided put / get into the members' buffers,
// signals that make those writes visible, and failures that name the member waited for, between
// thread-ranks and between ranks that map POSIX segments as processes do.
#include <hp/comm/init.h>
#include <hp/comm/process_group.h>
#include <hp/comm/symmetric_memory.h>
#include <hp/core/error.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "as_processes.h"
#include "hp/core/job.h"
#include "scoped_env.h"
#include "test_util.h"

namespace hp::test {
namespace {

using comm::ProcessGroup;
using comm::SymmetricMemory;

// Member `rank`'s message of round `k`: known to every member.
at::Tensor message(int rank, int k, int64_t numel) {
  return at::arange(numel, at::kFloat).mul_(1.0f / 64).add_(1000.0f * rank + k);
}

// A ring that reuses one place per round: each member puts its message into the next member's
// buffer and signals it; the next member reads it as soon as its wait returns, then signals back on
// another channel that the place is free. Every read sees the message of its round: the signal
// orders the put before it, and the writer never overwrites a place not yet read. Messages span
// several pages and rounds alternate between two places, so a wait that returns early shows as
// the previous round's values or a mix. (On x86, which keeps stores in order, only the compiler
// could reorder a put past its signal: the test cannot show a missing fence there.)
void ring(const ProcessGroup& world, int rounds) {
  const int n = world.size(), me = world.rank(), next = (me + 1) % n, previous = (me + n - 1) % n;
  constexpr int64_t kNumel = 5000;
  const int64_t place_bytes = kNumel * 4;
  SymmetricMemory memory = SymmetricMemory::allocate(world, 2 * place_bytes, /*channels=*/2);
  for (int k = 0; k < rounds; ++k) {
    const int64_t place = (k % 2) * place_bytes;
    if (k >= 2) memory.wait_signal(next, 1);  // `next` has read what this member put there two rounds ago
    memory.put(message(me, k, kNumel), next, place);
    memory.put_signal(next, 0);
    memory.wait_signal(previous, 0);
    const at::Tensor got = memory.buffer(me, at::kFloat, {kNumel}, place).clone();
    memory.put_signal(previous, 1);
    if (!at::equal(got, message(previous, k, kNumel)))
      throw std::runtime_error("round " + std::to_string(k) + ": member " + std::to_string(me) +
                               " read something other than member " + std::to_string(previous) + "'s message");
  }
  memory.barrier();
}

// The ring on 2 and 4 thread-ranks (plain memory).
TEST(SymmetricMemory, PutThenSignalIsSeenAfterTheWaitBetweenThreads) {
  for (int world : {2, 4}) run(world, [](const ProcessGroup& g) { ring(g, 200); });
}

// The ring on 4 ranks that map a POSIX segment as processes do; nothing stays linked in /dev/shm.
TEST(SymmetricMemory, PutThenSignalIsSeenAfterTheWaitBetweenProcessSegments) {
  ScopedEnv job_dir(job::kDirEnv, "/tmp/hprun-symmtest" + std::to_string(getpid()));
  const std::string prefix = job::shm_prefix();
  comm::ProcessGroupOptions options;
  options.set_timeout(std::chrono::seconds(20));
  const std::vector<std::string> errors = run_as_processes(4, options, 4, [&](const ProcessGroup& world) {
    ring(world, 100);
    // Mapped by every member: nothing of the job is linked in /dev/shm any more.
    if (!segments_named(prefix).empty()) throw std::runtime_error("a segment is still linked in /dev/shm");
  });
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

// get reads another member's buffer as it was written (through a buffer() view, in a dtype of the
// reader's choosing at an offset); buffer() views keep the memory after the SymmetricMemory is gone.
TEST(SymmetricMemory, GetReadsWhatTheOwnerWroteAndViewsOutliveTheHandle) {
  run(3, [](const ProcessGroup& g) {
    at::Tensor kept;
    {
      SymmetricMemory memory = SymmetricMemory::allocate(g, 1 << 16);
      EXPECT_EQ(memory.rank(), g.rank());
      EXPECT_EQ(memory.size(), 3);
      EXPECT_EQ(memory.bytes(), 1 << 16);
      memory.buffer(g.rank(), at::kLong, {10}, 8).copy_(at::arange(10, at::kLong) * (g.rank() + 1));
      memory.barrier();
      for (int peer = 0; peer < 3; ++peer) {
        at::Tensor got = at::empty({10}, at::kLong);
        memory.get(got, peer, 8);
        EXPECT_TRUE(at::equal(got, at::arange(10, at::kLong) * (peer + 1))) << "from " << peer;
      }
      kept = memory.buffer((g.rank() + 1) % 3, at::kLong, {10}, 8);
      memory.barrier();
    }
    g.barrier();  // every member's SymmetricMemory is gone: only the views keep the memory
    EXPECT_TRUE(at::equal(kept, at::arange(10, at::kLong) * ((g.rank() + 1) % 3 + 1)));
  });
}

// Signals count: three put_signals satisfy three waits, and a fourth times out naming the sender;
// after that the memory refuses further use. A member's own signals work too.
TEST(SymmetricMemory, SignalsCountAndAMissingOneTimesOutNamingTheSender) {
  run(2, [](const ProcessGroup& g) {
    SymmetricMemory memory = SymmetricMemory::allocate(g, 64, 3);
    const int other = 1 - g.rank();
    for (int i = 0; i < 3; ++i) memory.put_signal(other, 2);
    for (int i = 0; i < 3; ++i) memory.wait_signal(other, 2);
    memory.put_signal(g.rank(), 0);
    memory.wait_signal(g.rank(), 0);
    const auto start = std::chrono::steady_clock::now();
    expect_error([&] { memory.wait_signal(other, 2, std::chrono::milliseconds(300)); },
                 {"world rank " + std::to_string(other) + " did not signal channel 2 within 300 ms"});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
    // The failed wait's signal could still come and satisfy the wrong wait: the memory is done.
    const std::string refused = "an earlier wait on this SymmetricMemory failed";
    expect_error([&] { memory.put_signal(other, 0); }, refused);
    expect_error([&] { memory.wait_signal(other, 0); }, refused);
    expect_error([&] { memory.put(at::ones({2}), other); }, refused);
    expect_error([&] { memory.get(at::ones({2}), other); }, refused);
    expect_error([&] { memory.barrier(); }, refused);
    // A handle moved from is empty, and says so.
    SymmetricMemory moved = std::move(memory);
    expect_error([&] { memory.rank(); }, "this handle is empty");  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(moved.rank(), g.rank());
    g.barrier();
  });
}

// A member that never calls allocate fails the others after the group's timeout, with a
// TimeoutError naming it.
TEST(SymmetricMemory, AMemberThatNeverAllocatesIsNamedAfterTheTimeout) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(1));
  options.barrier_at_exit = false;  // rank 1 would wait there as long as rank 0 in allocate
  std::string said;
  run(
      2,
      [&](const ProcessGroup& g) {
        if (g.rank() == 1) return;  // never allocates
        try {
          SymmetricMemory::allocate(g, 64);
        } catch (const hp::TimeoutError& e) {
          said = e.what();
        }
      },
      options);
  EXPECT_NE(said.find("SymmetricMemory::allocate on group 'world' (world ranks [0, 1]), world rank 0: world rank 1 "
                      "did not arrive within 1000 ms"),
            std::string::npos)
      << said;
}

// A member whose SymmetricMemory is destroyed (here, its rank gave up) fails the member waiting for
// it at once, naming it, long before the group's timeout.
TEST(SymmetricMemory, AMemberThatLeavesFailsTheWaiterAtOnce) {
  testing::RunRanksOptions options;
  options.group.set_timeout(std::chrono::seconds(60));
  options.barrier_at_exit = false;
  std::string said;
  std::chrono::steady_clock::duration waited{};
  run(
      2,
      [&](const ProcessGroup& g) {
        SymmetricMemory memory = SymmetricMemory::allocate(g, 64);
        if (g.rank() == 1) return;  // leaves without a signal
        const auto start = std::chrono::steady_clock::now();
        try {
          memory.wait_signal(1);
        } catch (const hp::Error& e) {
          said = e.what();
        }
        waited = std::chrono::steady_clock::now() - start;
      },
      options);
  EXPECT_NE(said.find("waiting for a signal from world rank 1 on channel 0, but world rank 1 left"), std::string::npos)
      << said;
  EXPECT_LT(waited, std::chrono::seconds(10));
}

// Bad arguments, on one member or all, are errors that say what is wrong, on every member; the
// group and later allocations are fine afterwards.
TEST(SymmetricMemory, BadCallsAreClearErrors) {
  run(2, [](const ProcessGroup& g) {
    SymmetricMemory memory = SymmetricMemory::allocate(g, 100, 2);
    expect_error([&] { memory.put(at::ones({26}), 1); }, "104 bytes at offset 0 are outside the buffer of 100 bytes");
    expect_error([&] { memory.get(at::ones({2}), 1, 99); }, "8 bytes at offset 99 are outside the buffer");
    // Sizes and offsets near int64's end are refused, not wrapped around.
    expect_error([&] { memory.get(at::ones({2}), 1, INT64_MAX - 4); }, "are outside the buffer of 100 bytes");
    expect_error([&] { memory.buffer(1, at::kFloat, {int64_t{1} << 62, 4}); }, "is more bytes than int64 counts");
    expect_error([&] { memory.buffer(1, at::kFloat, {int64_t{1} << 60}); }, "are outside the buffer of 100 bytes");
    expect_error([&] { memory.wait_signal(1, 0, std::chrono::milliseconds(-5)); }, "the timeout must be >= 0 ms");
    expect_error([&] { memory.put(at::ones({2}), 2); }, "peer 2 is not a member (the group has 2)");
    expect_error([&] { memory.put_signal(1, 2); }, "channel 2 is not one of the 2 allocated");
    expect_error([&] { memory.wait_signal(-1); }, "sender -1 is not a member");
    expect_error([&] { memory.buffer(0, at::kFloat, {2}, 2); }, "offset 2 is not a multiple of Float's 4 bytes");
    expect_error([&] { SymmetricMemory::allocate(g, -1); }, "bytes must be in [0, 2^40], got -1");
    expect_error([&] { SymmetricMemory::allocate(g, int64_t{1} << 62); }, "bytes must be in [0, 2^40]");
    expect_error([&] { SymmetricMemory::allocate(g, 8, 0); }, "channels must be in [1, 1024], got 0");
    expect_error([&] { SymmetricMemory::allocate(g, 8, 1025); }, "channels must be in [1, 1024], got 1025");
    // One member's bad request fails every member alike, and later allocations still agree.
    expect_error([&] { SymmetricMemory::allocate(g, g.rank() == 1 ? -1 : 64); },
                 {"world rank 0: 64 bytes, 1 channels; world rank 1: refused: bytes must be in [0, 2^40], got -1"});
    // Members that ask for different sizes all fail, saying what each asked for.
    expect_error([&] { SymmetricMemory::allocate(g, g.rank() == 0 ? 64 : 128); },
                 {"every member must ask for the same bytes and channels", "world rank 0: 64 bytes, 1 channels",
                  "world rank 1: 128 bytes, 1 channels"});
    // The group is fine afterwards.
    SymmetricMemory again = SymmetricMemory::allocate(g, 8);
    again.barrier();
  });
  expect_error([] { SymmetricMemory::allocate(comm::fake_world(4, 0), 64); }, "a fake world's groups have no memory");
}

// Members on different hosts cannot share memory: every member is told so.
TEST(SymmetricMemory, MembersOnTwoHostsAreRefused) {  // on every member
  comm::ProcessGroupOptions options;
  options.set_timeout(std::chrono::seconds(20));
  const std::vector<std::string> errors =
      run_as_processes(4, options, 2, [&](const ProcessGroup& world) { SymmetricMemory::allocate(world, 64); });
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(errors[rank].find("its members are not all on this host"), std::string::npos) << errors[rank];
}

}  // namespace
}  // namespace hp::test
