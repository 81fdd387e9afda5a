// Waiting on words in memory that threads or processes share (comm/shared_segment.h): a futex on a
// 32-bit word, a pause for spinning, and whether a member's process is gone. The shared-memory
// transport (comm/shm_channel.h) and symmetric memory (hp/comm/symmetric_memory.h) wait with these.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

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

}  // namespace hp::comm::detail
