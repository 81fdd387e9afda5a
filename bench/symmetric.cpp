// bench/symmetric: round-trip latency of a message between two ranks through symmetric memory
// (hp::comm::SymmetricMemory: put into the peer's buffer, put_signal; the peer waits, answers the
// same way), side by side with the same message sent and received over Gloo (the group's send /
// recv) in the same run, in alternating blocks of round trips.
//
//   build/bin/bench_symmetric [--iters 2000]                      ranks as threads of one process
//   build/bin/hprun --nproc-per-node 2 build/bin/bench_symmetric  ranks as processes
//
// Prints, per message size, rank 0's median over blocks of the mean round trip, and their ratio.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/timing.h"
#include "hp/comm/init.h"
#include "hp/comm/process_group.h"
#include "hp/comm/symmetric_memory.h"
#include "hp/testing/run_ranks.h"

namespace {

using hp::bench::median;
using hp::comm::ProcessGroup;

void measure(const ProcessGroup& g, int iters) {
  const int me = g.rank(), other = 1 - me;
  const std::vector<int64_t> sizes = {1 << 10, 64 << 10, 1 << 20};
  const hp::comm::SymmetricMemory memory = hp::comm::SymmetricMemory::allocate(g, sizes.back());
  if (me == 0) std::printf("%10s %16s %16s %9s\n", "bytes", "symmetric us", "gloo us", "ratio");
  for (int64_t bytes : sizes) {
    at::Tensor message = at::randn({bytes / 4});
    const auto symmetric = [&] {
      if (me == 0) {
        memory.put(message, other);
        memory.put_signal(other);
        memory.wait_signal(other);
      } else {
        memory.wait_signal(other);
        memory.put(message, other);
        memory.put_signal(other);
      }
    };
    const auto gloo = [&] {
      if (me == 0) {
        g.send(message, other);
        g.recv(message, other);
      } else {
        g.recv(message, other);
        g.send(message, other);
      }
    };
    // Blocks of round trips, alternating between the two: call by call, Gloo's threads (still
    // finishing the previous send) would take the cores from the spinning waits.
    const auto block = [](const auto& round_trip, int calls) {
      return hp::bench::seconds([&] {
               for (int i = 0; i < calls; ++i) round_trip();
             }) /
             calls;
    };
    const int calls = bytes >= (1 << 20) ? 10 : 50;
    std::vector<double> symmetric_s, gloo_s;
    for (int b = 0; b < iters / calls + 2; ++b) {
      const double s = block(symmetric, calls), q = block(gloo, calls);
      if (b < 2) continue;  // warm-up
      symmetric_s.push_back(s);
      gloo_s.push_back(q);
    }
    if (me == 0)
      std::printf("%10lld %16.2f %16.2f %9.3f\n", static_cast<long long>(bytes), median(symmetric_s) * 1e6,
                  median(gloo_s) * 1e6, median(symmetric_s) / median(gloo_s));
  }
  memory.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 2000;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_symmetric [--iters 2000] (under hprun: --nproc-per-node 2)\n");
      return 2;
    }
  }
  if (std::getenv("WORLD_SIZE") != nullptr) {  // ranks are processes started by hprun
    const ProcessGroup world = hp::comm::init_process_group();
    if (world.size() != 2) {
      std::fprintf(stderr, "bench_symmetric: run it on 2 ranks (got %d)\n", world.size());
      return 2;
    }
    if (world.rank() == 0) std::printf("ranks are processes (hprun)\n");
    measure(world, iters);
  } else {
    std::printf("ranks are threads of one process\n");
    hp::testing::run_ranks(2, [&](const ProcessGroup& g) { measure(g, iters); });
  }
  return 0;
}
