// bench/collectives: bus bandwidth of all_reduce, all_gather, reduce_scatter and all_to_all
// through the hp::comm facade, side by side with the same data moved by raw c10d (Gloo) calls in
// the same run.
//
//   build/bin/bench_collectives [--quick] [--ranks 2,4] [--max-mb 64] [--transport auto|gloo|shm]
//                               [--wire native|bf16|fp8_e4m3]
//   build/bin/hprun --nproc-per-node 4 build/bin/bench_collectives [--transport ...]   as processes
//
// The facade uses the transport its group picks (--transport, default auto: shared memory, as every
// rank is on this host); with --transport gloo the ratio is the facade's own overhead over Gloo.
// --wire: the facade's all_reduce and reduce_scatter carry the fp32 data in that format
// (hp::comm::WireFormat), raw Gloo in fp32; bandwidths count the fp32 bytes on both sides.
// The last line also gives each size's bus bandwidth as a fraction of one memcpy of that size.
//
// Facade and raw calls alternate call by call, so drift and interference hit both alike; each
// figure is rank 0's median time per call. At 1 KB that order also lets one path's skew between the
// members (who leaves a Gloo call when) land in the other's time, so 1 KB is measured back to back
// as well: blocks of 100 calls of one path, the two paths' blocks alternating, each block started
// by a barrier; the median over blocks of the time per call. Bus bandwidth follows nccl-tests:
// all_reduce moves 2(n-1)/n of the data per rank, all_gather / reduce_scatter (n-1)/n.
// Gloo (LibTorch 1.13) has no reduce_scatter, so "raw" there is the least raw c10d can do:
// alltoall_base plus a local sum; the facade's version is the same algorithm in a fixed tree order.
// Both sides write into preallocated outputs (all_gather_into_tensor, reduce_scatter_tensor), so
// the ratio is the facade's overhead, not the cost of fresh memory.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/timing.h"
#include "comm/group_impl.h"
#include "hp/comm/init.h"
#include "hp/comm/process_group.h"
#include "hp/comm/wire_format.h"
#include "hp/testing/run_ranks.h"

namespace {

using hp::comm::ProcessGroup;
struct Row {
  std::string collective;
  int ranks;
  int64_t bytes;
  double facade_us, raw_us;
  double bus_factor;  // bus bytes per data byte
};

using hp::bench::median;
const auto time_one = hp::bench::seconds;

void wait_raw(const hp::comm::shim::NativeWork& w) { w->wait(); }

struct Case {
  const char* name;
  double bus_factor;
  std::function<void()> facade, raw;
  // Issue only (the caller's CPU cost before any waiting); the result is waited on untimed.
  std::function<hp::comm::Work()> facade_issue;
  std::function<hp::comm::shim::NativeWork()> raw_issue;
};

std::vector<Case> make_cases(const ProcessGroup& g, int64_t numel, hp::comm::WireFormat wire) {
  auto& impl = g.impl();
  auto& native = *impl.native;
  const int n = g.size();
  const int64_t per_rank = numel / n;
  at::Tensor buffer = at::randn({numel});
  at::Tensor shard = at::randn({per_rank});
  at::Tensor gathered = at::empty({per_rank * n});
  at::Tensor gathered_hp = at::empty({per_rank * n});
  at::Tensor piece_hp = at::empty({per_rank});
  at::Tensor received = at::empty({numel});
  std::vector<at::Tensor> outputs = gathered.chunk(n);
  std::vector<int64_t> splits(n, per_rank);
  const hp::comm::AllReduceOptions all_reduce{hp::comm::ReduceOp::kSum, wire};
  hp::comm::ReduceScatterOptions reduce_scatter;
  reduce_scatter.wire = wire;
  return {
      {"all_reduce", 2.0 * (n - 1) / n, [=] { g.all_reduce(buffer, all_reduce); },
       [=, &native] { wait_raw(hp::comm::shim::all_reduce(native, buffer, hp::comm::ReduceOp::kSum)); },
       [=] { return g.all_reduce_async(buffer, all_reduce); },
       [=, &native] { return hp::comm::shim::all_reduce(native, buffer, hp::comm::ReduceOp::kSum); }},
      {"all_gather", 1.0 * (n - 1) / n, [=] { g.all_gather_into_tensor(gathered_hp, shard); },
       [=, &native] { wait_raw(hp::comm::shim::all_gather(native, outputs, shard)); },
       [=] { return g.all_gather_into_tensor_async(gathered_hp, shard); },
       [=, &native] { return hp::comm::shim::all_gather(native, outputs, shard); }},
      {"all_to_all", 1.0 * (n - 1) / n, [=] { g.all_to_all(buffer); },
       [=, &native] { wait_raw(hp::comm::shim::all_to_all(native, received, buffer, splits, splits)); },
       [=] { return g.all_to_all_async(buffer); },
       [=, &native] { return hp::comm::shim::all_to_all(native, received, buffer, splits, splits); }},
      {"reduce_scatter", 1.0 * (n - 1) / n, [=] { g.reduce_scatter_tensor(piece_hp, buffer, reduce_scatter); },
       [=, &native] {
         wait_raw(hp::comm::shim::all_to_all(native, received, buffer, splits, splits));
         at::Tensor piece = piece_hp;  // the same preallocated output the facade writes
         at::sum_out(piece, received.view({n, per_rank}), 0);
       },
       [=] { return g.reduce_scatter_tensor_async(piece_hp, buffer, reduce_scatter); },
       [=, &native] { return hp::comm::shim::all_to_all(native, received, buffer, splits, splits); }},
  };
}

}  // namespace

int usage() {
  std::fprintf(stderr,
               "usage: bench_collectives [--quick] [--ranks 2,4] [--max-mb 64] [--transport auto|gloo|shm] "
               "[--wire native|bf16|fp8_e4m3]\n");
  return 2;
}

// Seconds of one memcpy of `bytes` (median of a few, after a warm-up), the ceiling of a transport
// that copies through memory.
double memcpy_seconds(int64_t bytes) {
  std::vector<char> from(bytes, 1), to(bytes, 0);
  std::vector<double> times;
  for (int i = 0; i < 7; ++i) times.push_back(time_one([&] { std::memcpy(to.data(), from.data(), bytes); }));
  return median(times);
}

int main(int argc, char** argv) {
  hp::comm::ProcessGroupOptions group_options;
  hp::comm::WireFormat wire = hp::comm::WireFormat::kNative;
  bool quick = false;
  std::vector<int> rank_counts = {2, 4};
  int64_t max_bytes = int64_t{64} << 20;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) {
      quick = true;
      max_bytes = 64 << 10;
    } else if (!std::strcmp(argv[i], "--ranks") && i + 1 < argc) {
      rank_counts.clear();
      std::stringstream list(argv[++i]);
      for (std::string item; std::getline(list, item, ',');) rank_counts.push_back(std::stoi(item));
    } else if (!std::strcmp(argv[i], "--max-mb") && i + 1 < argc) {
      max_bytes = static_cast<int64_t>(std::stod(argv[++i]) * (1 << 20));
    } else if (!std::strcmp(argv[i], "--transport") && i + 1 < argc) {
      const std::string name = argv[++i];
      bool known = false;
      for (auto t : {hp::comm::Transport::kAuto, hp::comm::Transport::kGloo, hp::comm::Transport::kShm}) {
        if (hp::comm::to_string(t) != name) continue;
        group_options.set_transport(t);
        known = true;
      }
      if (!known) return usage();
    } else if (!std::strcmp(argv[i], "--wire") && i + 1 < argc) {
      const std::optional<hp::comm::WireFormat> named = hp::comm::wire_format_named(argv[++i]);
      if (!named) return usage();
      wire = *named;
    } else {
      return usage();
    }
  }
  at::set_num_threads(1);  // the ranks share 2 cores; intra-op threads would only contend

  std::vector<Row> rows;
  std::string facade_transport;
  std::map<std::string, std::pair<double, double>> issue_us;   // 1 KB: facade, raw median issue time
  std::map<std::string, std::pair<double, double>> streak_us;  // 1 KB back to back: facade, raw per call
  std::mutex rows_mu;
  auto measure = [&](const ProcessGroup& g) {
    const int n = g.size();
    g.barrier();  // every rank is here before the first timed call
    if (g.rank() == 0) facade_transport = g.impl().shm ? "shared memory" : "gloo";
    for (int64_t bytes = 1024; bytes <= max_bytes; bytes *= 4) {
      const int64_t numel = std::max<int64_t>(n, bytes / 4 / n * n);
      // Calls alternate facade / raw, each timed alone; the medians of the two lists are compared.
      const int calls = static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / bytes, 5, quick ? 10 : 300));
      for (Case& c : make_cases(g, numel, wire)) {
        c.facade();  // warm up both paths (buffers, Gloo algorithm caches)
        c.raw();
        std::vector<double> facade, raw;
        for (int i = 0; i < calls; ++i) {  // swap which goes first, so neither always follows the other
          if (i % 2 == 0) facade.push_back(time_one(c.facade));
          raw.push_back(time_one(c.raw));
          if (i % 2 == 1) facade.push_back(time_one(c.facade));
        }
        if (g.rank() == 0) {
          std::lock_guard<std::mutex> lock(rows_mu);
          rows.push_back({c.name, n, numel * 4, median(facade) * 1e6, median(raw) * 1e6, c.bus_factor});
        }
        if (bytes != 1024) continue;
        // The facade's own CPU cost at 1 KB: time only the issuing call, then wait untimed.
        std::vector<double> facade_issue, raw_issue;
        for (int i = 0; i < calls; ++i) {
          hp::comm::Work w;
          facade_issue.push_back(time_one([&] { w = c.facade_issue(); }));
          w.wait();
          hp::comm::shim::NativeWork nw;
          raw_issue.push_back(time_one([&] { nw = c.raw_issue(); }));
          wait_raw(nw);
        }
        constexpr int kBlock = 100;
        std::vector<double> facade_block, raw_block;
        for (int b = 0; b < (quick ? 2 : 7); ++b) {
          g.barrier();
          facade_block.push_back(time_one([&] {
                                   for (int i = 0; i < kBlock; ++i) c.facade();
                                 }) /
                                 kBlock);
          g.barrier();
          raw_block.push_back(time_one([&] {
                                for (int i = 0; i < kBlock; ++i) c.raw();
                              }) /
                              kBlock);
        }
        if (g.rank() == 0) {
          std::lock_guard<std::mutex> lock(rows_mu);
          const std::string key = c.name + std::string(" ranks=") + std::to_string(n);
          issue_us[key] = {median(facade_issue) * 1e6, median(raw_issue) * 1e6};
          streak_us[key] = {median(facade_block) * 1e6, median(raw_block) * 1e6};
        }
      }
    }
  };
  const bool under_launcher = std::getenv("WORLD_SIZE") != nullptr;
  if (under_launcher) {  // ranks are processes started by hprun
    hp::comm::InitOptions init;
    init.group = group_options;
    ProcessGroup world = hp::comm::init_process_group(init);
    measure(world);
    if (world.rank() != 0) return 0;
  } else {  // ranks are threads of this process
    for (int n : rank_counts) {
      hp::testing::RunRanksOptions options;
      options.watchdog = std::chrono::minutes(30);
      options.group = group_options;
      hp::testing::run_ranks(n, measure, options);
    }
  }
  std::printf(
      "ranks are %s; the facade's transport: %s, its reductions' wire format: %s; each figure is rank 0's median time "
      "per call, facade and "
      "c10d (Gloo) calls alternating\n\n",
      under_launcher ? "processes (hprun)" : "threads of one process", facade_transport.c_str(),
      hp::comm::to_string(wire).c_str());

  std::printf("%-15s %5s %10s %12s %12s %11s %11s %9s\n", "collective", "ranks", "bytes", "hp us", "c10d us", "hp GB/s",
              "c10d GB/s", "hp/c10d");
  std::map<std::string, std::vector<double>> big_ratios;
  std::map<std::string, double> small_overhead_us;
  for (const Row& r : rows) {
    const double busbw = [&](double us) { return r.bytes * r.bus_factor / (us * 1e-6) / 1e9; }(r.facade_us);
    const double raw_busbw = r.bytes * r.bus_factor / (r.raw_us * 1e-6) / 1e9;
    std::printf("%-15s %5d %10lld %12.1f %12.1f %11.3f %11.3f %9.3f\n", r.collective.c_str(), r.ranks,
                static_cast<long long>(r.bytes), r.facade_us, r.raw_us, busbw, raw_busbw, r.facade_us / r.raw_us);
    if (r.bytes >= (1 << 20)) big_ratios[r.collective].push_back(r.facade_us / r.raw_us);
    if (r.bytes == 1024)
      small_overhead_us[r.collective] = std::max(small_overhead_us[r.collective], r.facade_us - r.raw_us);
  }
  std::printf("\nissue path at 1 KB, median us per call (facade / c10d):");
  for (const auto& [name, us] : issue_us) std::printf("  %s %.1f / %.1f", name.c_str(), us.first, us.second);
  std::printf("\nback to back at 1 KB, median us per call (facade / c10d = ratio):");
  for (const auto& [name, us] : streak_us)
    std::printf("  %s %.1f / %.1f = %.3f", name.c_str(), us.first, us.second, us.first / us.second);
  std::printf("\nfacade overhead at 1 KB, whole call (worst over rank counts, us):");
  for (const auto& [name, us] : small_overhead_us) std::printf(" %s %+.1f", name.c_str(), us);
  std::printf("\nratio hp/c10d time, median over sizes >= 1 MB:");
  for (const auto& [name, ratios] : big_ratios) std::printf(" %s %.3f", name.c_str(), median(ratios));
  std::printf("\nmemcpy of the same bytes in one thread, GB/s:");
  for (int64_t bytes = 1 << 20; bytes <= max_bytes; bytes *= 4)
    std::printf(" %lld B %.2f", static_cast<long long>(bytes), bytes / memcpy_seconds(bytes) / 1e9);
  std::printf("\n");
  return 0;
}
