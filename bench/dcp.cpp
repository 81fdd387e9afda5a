// bench/dcp: checkpoint throughput against plain file I/O of the same bytes, and how long training
// is blocked by an async save versus a synchronous one, measured side by side in one run.
//
// 4 ranks (threads) each hold a quarter of a state dict (Shard(0) tensors).
//   save: dcp::save vs each rank writing its bytes to one file with one write + fsync (target >= 0.7)
//   load: dcp::load into the same layout vs each rank reading its file back (target >= 0.7)
//   async: time a step is blocked by save_async + wait_staged() + wait() one step later, vs by
//          save() (target <= 10%), with staging before save_async returns or in the background. The
//          step is time-boxed, either busy on the CPU (CPU training: the save's threads compete
//          with it, which shows as a slower writer, not as a longer step) or idle (an accelerator
//          computes while the CPU writes).
//
//   build/bin/bench_dcp [--quick]
#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <thread>

#include <functional>

#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <mutex>

#include "bench/timing.h"
#include "hp/dcp/checkpoint.h"
#include "hp/dtensor/dtensor.h"
#include "hp/mesh/device_mesh.h"
#include "hp/testing/run_ranks.h"

namespace {
namespace fs = std::filesystem;
constexpr int kRanks = 4;

hp::dcp::StateDict make_state(const hp::comm::ProcessGroup& world, int64_t total_mb) {
  const hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {kRanks});
  hp::dcp::StateDict state;
  const int64_t tensors = 8, rows = total_mb * (1 << 20) / 4 / tensors / 1024;
  for (int64_t i = 0; i < tensors; ++i)
    state.tensors["t" + std::to_string(i)] = hp::distribute_tensor(at::rand({rows, 1024}), mesh, {hp::Shard(0)});
  return state;
}

double plain_write(const std::string& path, const std::vector<at::Tensor>& pieces) {
  return hp::bench::seconds([&] {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (const auto& p : pieces) {
      const char* data = static_cast<const char*>(p.data_ptr());
      size_t left = p.numel() * 4;
      while (left > 0) {
        const ssize_t n = ::write(fd, data, left);
        if (n <= 0) break;
        data += n;
        left -= n;
      }
    }
    ::fsync(fd);
    ::close(fd);
  });
}

double plain_read(const std::string& path, std::vector<at::Tensor>& pieces) {
  return hp::bench::seconds([&] {
    const int fd = ::open(path.c_str(), O_RDONLY);
    off_t at = 0;
    for (auto& p : pieces) {
      const size_t bytes = p.numel() * 4;
      if (::pread(fd, p.data_ptr(), bytes, at) != static_cast<ssize_t>(bytes)) std::abort();
      at += bytes;
    }
    ::close(fd);
  });
}

// Loads are measured from disk, as after a restart: the page cache is dropped first when this
// process may (root); otherwise both loads read from the cache and the report says so.
bool drop_page_cache() {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "3", 1) == 1;
  ::close(fd);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int64_t total_mb = quick ? 16 : 256;
  const int rounds = quick ? 1 : 3;
  const std::string dir = (fs::temp_directory_path() / ("hp_bench_dcp_" + std::to_string(::getpid()))).string();
  fs::create_directories(dir);
  std::vector<double> dcp_save, plain_save, dcp_load, plain_load, sync_blocked, async_blocked, background_blocked,
      sync_idle_blocked, background_idle_blocked;
  std::mutex mu;
  bool cold = false;
  hp::testing::run_ranks(kRanks, [&](const hp::comm::ProcessGroup& world) {
    hp::dcp::StateDict state = make_state(world, total_mb);
    std::vector<at::Tensor> pieces;
    for (auto& [name, t] : state.tensors) pieces.push_back(hp::DTensor(t).to_local());
    const std::string plain = dir + "/plain-" + std::to_string(world.rank());
    for (int round = 0; round < rounds; ++round) {
      // save: the slowest rank's time is the job's time
      // Each write goes to new files with nothing dirty in the page cache, so neither pays for the
      // other's writeback.
      const std::string round_tag = std::to_string(round);
      if (world.rank() == 0) ::sync();
      world.barrier();
      const double d = hp::bench::seconds([&] { hp::dcp::save(state, dir + "/ckpt" + round_tag, world); });
      if (world.rank() == 0) ::sync();
      world.barrier();
      const double p = plain_write(plain + "." + round_tag, pieces);
      if (world.rank() == 0) cold = drop_page_cache();
      world.barrier();
      const double dl = hp::bench::seconds([&] { hp::dcp::load(state, dir + "/ckpt" + round_tag); });
      world.barrier();
      if (world.rank() == 0) drop_page_cache();
      world.barrier();
      const double pl = plain_read(plain + "." + round_tag, pieces);
      // blocked: a training step of ~ one synchronous save, then the save's collective wait. Two
      // kinds of step: CPU-bound (matmuls, as CPU training; the save's threads compete with it for
      // this machine's 2 cores) and accelerator-bound (the CPU idles, as while a GPU computes).
      // A step is 1.5 x the synchronous save: 90% forward and backward, then the optimizer step
      // (where the trainer calls wait_staged() first), then the save's wait() at the step's end.
      const at::Tensor a = at::rand({512, 512});
      const auto busy = [&](double seconds) {
        const auto start = std::chrono::steady_clock::now();
        while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds)
          (void)at::mm(a, a);
      };
      const auto idle = [](double seconds) { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); };
      int saves = 0;
      // Each save goes to a new directory with nothing dirty in the page cache; the previous one is
      // removed first, so every measure starts from the same amount of data on disk.
      const auto fresh_dir = [&] {
        world.barrier();
        if (world.rank() == 0) {
          if (saves > 0) fs::remove_all(dir + "/blocked" + round_tag + "-" + std::to_string(saves - 1));
          ::sync();
        }
        world.barrier();
        return dir + "/blocked" + round_tag + "-" + std::to_string(saves++);
      };
      const auto blocked_by = [&](const std::function<void(double)>& compute, bool async, bool background) {
        const std::string target = fresh_dir();
        const double forward_backward = 1.35 * d, optimizer = 0.15 * d;
        if (!async) {
          const double t = hp::bench::seconds([&] { hp::dcp::save(state, target, world); });
          compute(forward_backward + optimizer);
          return t;
        }
        hp::dcp::SaveOptions options;
        options.stage_in_background = background;
        hp::dcp::AsyncSave pending;
        double t = hp::bench::seconds([&] { pending = hp::dcp::save_async(state, target, world, options); });
        compute(forward_backward);
        t += hp::bench::seconds([&] { pending.wait_staged(); });
        compute(optimizer);
        t += hp::bench::seconds([&] { pending.wait(); });
        return t;
      };
      const auto cpu_step = busy;
      const auto accelerator_step = idle;
      const double sync_idle = blocked_by(accelerator_step, false, false);
      const double background_idle = blocked_by(accelerator_step, true, true);
      const double sync = blocked_by(cpu_step, false, false);
      const double blocked = blocked_by(cpu_step, true, false);
      const double background_wait = blocked_by(cpu_step, true, true);
      // The slowest rank's time is the job's time.
      const at::Tensor slowest = world.all_reduce(
          at::tensor({d, p, dl, pl, sync, blocked, background_wait, sync_idle, background_idle}, at::kDouble),
          {hp::comm::ReduceOp::kMax});
      const auto at_most = [&](int i) { return slowest[i].item<double>(); };
      std::lock_guard<std::mutex> lock(mu);
      if (world.rank() == 0) {
        dcp_save.push_back(at_most(0)), plain_save.push_back(at_most(1));
        dcp_load.push_back(at_most(2)), plain_load.push_back(at_most(3));
        sync_blocked.push_back(at_most(4)), async_blocked.push_back(at_most(5));
        background_blocked.push_back(at_most(6));
        sync_idle_blocked.push_back(at_most(7)), background_idle_blocked.push_back(at_most(8));
      }
    }
  });
  using hp::bench::median;
  const double mb = static_cast<double>(total_mb);
  std::cout << std::fixed << std::setprecision(1) << "bench_dcp: " << total_mb << " MB over " << kRanks
            << " ranks (threads), median of " << rounds << "\n"
            << "  save  dcp " << mb / median(dcp_save) << " MB/s, plain write+fsync " << mb / median(plain_save)
            << " MB/s, ratio " << std::setprecision(2) << median(plain_save) / median(dcp_save) << " (target >= 0.7)\n"
            << std::setprecision(1) << "  load (" << (cold ? "page cache dropped" : "from the page cache") << ")  dcp "
            << mb / median(dcp_load) << " MB/s, plain read " << mb / median(plain_load) << " MB/s, ratio "
            << std::setprecision(2) << median(plain_load) / median(dcp_load) << " (target >= 0.7)\n"
            << std::setprecision(1) << "  blocked by a save, CPU-bound step: sync " << 1e3 * median(sync_blocked)
            << " ms, async staged before returning " << 1e3 * median(async_blocked) << " ms (ratio "
            << std::setprecision(3) << median(async_blocked) / median(sync_blocked) << "), staged in the background "
            << std::setprecision(1) << 1e3 * median(background_blocked) << " ms (ratio " << std::setprecision(3)
            << median(background_blocked) / median(sync_blocked) << ")\n"
            << std::setprecision(1) << "  blocked by a save, accelerator-bound step: sync "
            << 1e3 * median(sync_idle_blocked) << " ms, async staged in the background "
            << 1e3 * median(background_idle_blocked) << " ms\n"
            << "  ratio async / sync, accelerator-bound step " << std::setprecision(3)
            << median(background_idle_blocked) / median(sync_idle_blocked) << " (target <= 0.10); CPU-bound step "
            << median(background_blocked) / median(sync_blocked) << "\n";
  fs::remove_all(dir);
  return 0;
}
