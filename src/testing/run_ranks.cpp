#include "hp/testing/run_ranks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include "hp/comm/init.h"
#include "hp/core/cpu_threads.h"
#include "hp/core/error.h"
#include "hp/core/log.h"

namespace hp::testing {
namespace {

// Shared with the rank threads; outlives run_ranks if the watchdog detaches them.
struct RunState {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<bool> done;
  std::vector<std::pair<int, std::string>> failures;  // (rank, message) in the order they failed
};

std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& c) {
    return c.what_without_backtrace();
  } catch (const std::exception& s) {
    return s.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

void run_ranks(int world_size, const std::function<void(const comm::ProcessGroup& world)>& fn,
               RunRanksOptions options) {
  HP_CHECK(world_size > 0, "run_ranks: world size must be positive, got ", world_size);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CpuThreadsGuard threads_guard(options.cpu_threads_per_rank > 0 ? options.cpu_threads_per_rank
                                                                 : std::max(1, cores / world_size));
  auto state = std::make_shared<RunState>();
  state->done.assign(world_size, false);
  const comm::InProcessRendezvous rendezvous;

  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back(
        [state, rendezvous, fn, rank, world_size, group = options.group, barrier = options.barrier_at_exit] {
          log::LogRankGuard log_rank(rank);
          std::exception_ptr failure;
          try {
            comm::ProcessGroup world = rendezvous.join(rank, world_size, group);
            fn(world);
            // Tear down together: a rank that finished early must not close its connections while a
            // peer is still using them (e.g. still completing the creation of a group they share).
            if (barrier) world.barrier();
          } catch (...) {
            failure = std::current_exception();  // `world` is gone by now: peers see its sockets close
          }
          std::lock_guard<std::mutex> lock(state->mu);
          if (failure) state->failures.emplace_back(rank, message_of(failure));
          state->done[rank] = true;
          state->cv.notify_all();
        });
  }

  std::unique_lock<std::mutex> lock(state->mu);
  const bool finished = state->cv.wait_for(lock, options.watchdog, [&] {
    return std::all_of(state->done.begin(), state->done.end(), [](bool d) { return d; });
  });
  if (!finished) {
    std::ostringstream msg;
    msg << "run_ranks: watchdog fired after " << options.watchdog.count() << " ms; ranks still running:";
    for (int r = 0; r < world_size; ++r)
      if (!state->done[r]) msg << " " << r;
    for (const auto& [rank, what] : state->failures) msg << "\n  rank " << rank << " failed: " << what;
    lock.unlock();
    for (auto& t : threads) t.detach();
    throw TimeoutError(msg.str());
  }
  lock.unlock();
  for (auto& t : threads) t.join();
  if (state->failures.empty()) return;
  std::ostringstream msg;
  msg << "run_ranks: " << state->failures.size() << " of " << world_size << " ranks failed (first failure first):";
  for (const auto& [rank, what] : state->failures) msg << "\n  rank " << rank << ": " << what;
  throw Error(msg.str());
}

}  // namespace hp::testing
