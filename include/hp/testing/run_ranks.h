// The in-process multi-rank harness: N ranks as N threads of one process, each with its own real
// Gloo world group, all rendezvousing through one shared in-memory store.
//
// Because the library keeps no process-global rank state, code run here is exactly the code that
// runs under hprun in N processes; only the rendezvous store differs.
#pragma once

#include <chrono>
#include <functional>

#include "hp/comm/process_group.h"

namespace hp::testing {

struct RunRanksOptions {
  // Options of each rank's world group (short timeout, so a missing peer fails a test quickly).
  comm::ProcessGroupOptions group = comm::ProcessGroupOptions().set_timeout(std::chrono::seconds(20));
  // After this long, run_ranks gives up on ranks still running, names them and throws
  // hp::TimeoutError instead of hanging (their threads are detached).
  std::chrono::milliseconds watchdog{std::chrono::seconds(120)};
  // Ranks that return normally meet in a world barrier before tearing down their groups, so a rank
  // that finishes early never closes connections a peer still uses. Tests whose ranks diverge on
  // purpose (a rank that never arrives) turn it off.
  bool barrier_at_exit = true;
  // CPU threads (ATen and OpenBLAS pools, shared by all ranks of the process) while the ranks run;
  // 0 = the machine's cores split over the ranks, at least 1.
  int cpu_threads_per_rank = 0;
};

// Runs fn(world) on `world_size` threads; world.rank() is the thread's rank. Returns when every
// rank has returned (see RunRanksOptions::barrier_at_exit). If any rank throws, throws hp::Error naming each failed
// rank and its message, the first to fail first. A rank that throws tears down its groups, so peers blocked on it fail
// promptly instead of waiting for the timeout.
void run_ranks(int world_size, const std::function<void(const comm::ProcessGroup& world)>& fn,
               RunRanksOptions options = {});

}  // namespace hp::testing
