// bench/dtensor_dispatch: what DTensor dispatch costs per op, and how fast redistribute moves data.
//
//   build/bin/bench_dtensor_dispatch [--quick]
//
// 1. Per-op overhead: a 64x64 add and a 64x64 mm on replicated DTensors (cached decisions, no
//    communication) versus the same op on the local tensors, on a 1-rank mesh; median over
//    alternating calls. The difference is the dispatch cost per op.
// 2. Redistribute S(0) -> R of a 16 MB fp32 tensor on 4 ranks (threads) versus a raw all_gather of
//    the same pieces through the same process group, alternating.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <vector>

#include "bench/timing.h"
#include "hp/dtensor/dtensor.h"
#include "hp/testing/run_ranks.h"

namespace {

using hp::bench::median;
using hp::bench::seconds;

// Median seconds per call of a and of b, timed in alternating batches of `batch` calls.
std::pair<double, double> compare(const std::function<void()>& a, const std::function<void()>& b, int rounds,
                                  int batch) {
  std::vector<double> ta, tb;
  for (int r = 0; r < rounds; ++r) {
    ta.push_back(seconds([&] {
                   for (int i = 0; i < batch; ++i) a();
                 }) /
                 batch);
    tb.push_back(seconds([&] {
                   for (int i = 0; i < batch; ++i) b();
                 }) /
                 batch);
  }
  return {median(ta), median(tb)};
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && !std::strcmp(argv[1], "--quick");
  at::set_num_threads(1);
  std::mutex print_mu;
  double add_overhead = 0, mm_overhead = 0, redistribute_ratio = 0;

  hp::testing::run_ranks(1, [&](const hp::comm::ProcessGroup& world) {
    hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {1}, {"x"});
    const at::Tensor a = at::randn({64, 64}), b = at::randn({64, 64});
    hp::DTensor da = hp::distribute_tensor(a, mesh, {hp::Replicate()});
    hp::DTensor db = hp::distribute_tensor(b, mesh, {hp::Replicate()});
    at::add(da, db);  // fill the decision caches
    at::mm(da, db);
    const int rounds = quick ? 3 : 31, batch = quick ? 20 : 200;
    auto [dt_add, local_add] = compare([&] { at::add(da, db); }, [&] { at::add(a, b); }, rounds, batch);
    auto [dt_mm, local_mm] = compare([&] { at::mm(da, db); }, [&] { at::mm(a, b); }, rounds, batch);
    add_overhead = (dt_add - local_add) * 1e6;
    mm_overhead = (dt_mm - local_mm) * 1e6;
    std::printf("%-28s %12s %12s %14s\n", "op (64x64 fp32, 1 rank)", "DTensor us", "local us", "overhead us");
    std::printf("%-28s %12.2f %12.2f %14.2f\n", "add", dt_add * 1e6, local_add * 1e6, add_overhead);
    std::printf("%-28s %12.2f %12.2f %14.2f\n", "mm", dt_mm * 1e6, local_mm * 1e6, mm_overhead);
  });

  hp::testing::run_ranks(4, [&](const hp::comm::ProcessGroup& world) {
    hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {4}, {"x"});
    const int64_t rows = quick ? 64 : 4096;  // 4096 x 1024 fp32 = 16 MB
    const at::Tensor full = at::randn({rows, 1024});
    hp::DTensor sharded = hp::distribute_tensor(full, mesh, {hp::Shard(0)});
    const at::Tensor piece = sharded.to_local();
    const hp::comm::ProcessGroup& group = mesh.get_group(0);
    const int rounds = quick ? 2 : 9;
    auto [t_redistribute, t_gather] =
        compare([&] { sharded.redistribute(mesh, {hp::Replicate()}); }, [&] { group.all_gather(piece); }, rounds, 1);
    if (world.rank() == 0) {
      std::lock_guard<std::mutex> lock(print_mu);
      const double mb = full.numel() * 4.0 / (1 << 20);
      std::printf("\n%-28s %12s %12s\n", "S(0)->R, 4 ranks (threads)", "ms", "GB/s bus");
      auto bus = [&](double s) { return full.numel() * 4.0 * 3 / 4 / s / 1e9; };
      std::printf("%-28s %12.2f %12.3f\n", ("redistribute " + std::to_string(static_cast<int>(mb)) + " MB").c_str(),
                  t_redistribute * 1e3, bus(t_redistribute));
      std::printf("%-28s %12.2f %12.3f\n", "raw all_gather", t_gather * 1e3, bus(t_gather));
      redistribute_ratio = t_gather / t_redistribute;
    }
  });
  std::printf(
      "\ndispatch overhead per op: add %.2f us, mm %.2f us; redistribute bandwidth / all_gather bandwidth = %.3f\n",
      add_overhead, mm_overhead, redistribute_ratio);
  return 0;
}
