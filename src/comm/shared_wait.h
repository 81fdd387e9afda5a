// Waiting on words in memory that threads or processes share (comm/shared_segment.h): a futex on a
// 32-bit word, whether a member's process is gone, and the wait both users of shared memory (the
// transport, comm/shm_channel.h, and symmetric memory, hp/comm/symmetric_memory.h) run.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace hp::comm::detail {

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "atomics in shared memory are shared between processes and must not hide a lock");

// Sleeps while *word == seen, for at most `at_most` (or until woken; spurious returns happen).
void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::nanoseconds at_most);
// Wakes every thread, of any process, sleeping on `word`.
void wake_all(std::atomic<uint32_t>* word);
// A hint to the core while spinning.
void cpu_relax();
// Whether the process has ended: gone, or a zombie its parent has not reaped yet.
bool process_gone(int64_t pid);

// A deadline `timeout` from now; a timeout too long for the clock (milliseconds::max() meaning
// "never") is cut to a century.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  constexpr std::chrono::hours kCentury{24 * 365 * 100};
  return std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(timeout, kCentury);
}

enum class WaitOutcome { kArrived, kHopeless, kTimedOut };

// Waits until arrived() holds, where whoever makes it hold changes `word` and wakes it. What is
// awaited usually comes within microseconds, from another core: spin, then yield (so waiters that
// share a core hand it over), and after 100 us sleep on the word in slices of `slice` (its wake-up
// alone costs tens of microseconds). Between slices hopeless() says whether waiting can still
// succeed (the other side failed, left or exited) and the deadline is looked at; arrived() is asked
// once more before giving up, so what was done just before the other side left still counts.
template <typename Arrived, typename Hopeless>
WaitOutcome wait_until(std::atomic<uint32_t>* word, Arrived arrived, Hopeless hopeless,
                       std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds slice) {
  const auto stop_spinning = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
  for (int i = 0;; ++i) {
    if (arrived()) return WaitOutcome::kArrived;
    if (i < 64) {
      cpu_relax();
      continue;
    }
    if (std::chrono::steady_clock::now() > stop_spinning) break;
    std::this_thread::yield();
  }
  for (;;) {
    const uint32_t seen = word->load(std::memory_order_acquire);
    if (arrived()) return WaitOutcome::kArrived;
    const auto left = deadline - std::chrono::steady_clock::now();
    futex_wait(word, seen, std::clamp<std::chrono::nanoseconds>(left, std::chrono::nanoseconds(0), slice));
    if (arrived()) return WaitOutcome::kArrived;
    if (hopeless()) return arrived() ? WaitOutcome::kArrived : WaitOutcome::kHopeless;
    if (std::chrono::steady_clock::now() >= deadline) return arrived() ? WaitOutcome::kArrived : WaitOutcome::kTimedOut;
  }
}

}  // namespace hp::comm::detail
