// bench/moe: a MoE layer's costs as ratios measured side by side in one run, fp32.
//
//  1. Grouped experts against one dense SwiGLU of equal FLOPs: 8 experts, top-2, 4096 tokens
//     (8192 rows), dim 256, hidden 512, forward + backward; rows spread evenly over the experts,
//     and skewed (half of them on one expert).
//  2. A MoE layer step (forward + backward) on 2 ranks with ep 2 against ep 1 (each rank running
//     all experts on its own tokens): the time ratio, next to the ratio of the experts' compute
//     alone on the rows each rank holds; and the all_to_all bytes of one forward against the
//     formula.
//  3. Shared experts (a dense SwiGLU, hidden 128) overlapping the dispatch all_to_all, ep 2 on 2
//     ranks: the dispatch and the shared experts timed alone and as the layer runs them (the
//     all_to_all issued, the shared experts, the wait); the fraction of the dispatch time hidden.
//     Also the whole layer's forward with and without the overlap.
//
//   build/bin/bench_moe [--quick]
#include <ATen/ATen.h>

#include <chrono>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <numeric>
#include <thread>

#include "bench/timing.h"
#include "hp/comm/comm_debug_mode.h"
#include "hp/comm/functional.h"
#include "hp/core/host_sync.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/init.h"
#include "hp/nn/moe.h"
#include "hp/parallel/expert_parallel.h"
#include "hp/testing/run_ranks.h"

namespace {

constexpr int64_t kExperts = 8, kTopK = 2, kTokens = 4096, kDim = 256, kHidden = 512, kShared = 128;

at::Tensor random(std::vector<int64_t> shape, uint64_t seed) {
  return at::randn(shape, at::make_generator<at::CPUGeneratorImpl>(seed));
}

// Median seconds of forward + backward of fn(rows) over `reps` calls after one warm-up.
double step_seconds(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& rows, int reps) {
  std::vector<double> times;
  for (int i = 0; i <= reps; ++i) {
    const at::Tensor x = rows.detach().requires_grad_(true);
    const double t = hp::bench::seconds([&] { fn(x).sum().backward(); });
    if (i > 0) times.push_back(t);
  }
  return hp::bench::median(times);
}

void grouped_against_dense(int reps) {
  hp::nn::GroupedExperts experts(kExperts, kDim, kHidden);
  hp::nn::init_parameters(experts, 1);
  hp::nn::SwiGLU dense(kDim, kHidden);
  hp::nn::init_parameters(dense, 2);
  const int64_t rows = kTokens * kTopK;
  const at::Tensor x = random({rows, kDim}, 3);
  const std::vector<int64_t> even(kExperts, rows / kExperts);
  std::vector<int64_t> skewed(kExperts, rows / 2 / (kExperts - 1));
  skewed[0] = rows - std::accumulate(skewed.begin() + 1, skewed.end(), int64_t{0});
  const double dense_s = step_seconds([&](const at::Tensor& r) { return dense(r); }, x, reps);
  std::cout << std::fixed << std::setprecision(2) << "grouped experts vs one dense SwiGLU of equal FLOPs (" << kExperts
            << " experts, top-" << kTopK << ", " << kTokens << " tokens, dim " << kDim << ", hidden " << kHidden
            << ", forward + backward, median of " << reps << "):\n  dense " << 1e3 * dense_s << " ms\n";
  for (const auto& [name, counts] : {std::pair{"even", even}, std::pair{"skewed (half on one expert)", skewed}}) {
    const double grouped_s = step_seconds([&](const at::Tensor& r) { return experts.run(r, counts); }, x, reps);
    std::cout << "  grouped, " << name << ": " << 1e3 * grouped_s << " ms, ratio " << std::setprecision(3)
              << grouped_s / dense_s << std::setprecision(2) << "\n";
  }
}

// The benchmarked layer: 8 experts, top-2 renormalized, hidden 512.
hp::nn::MoEOptions layer_options() {
  hp::nn::MoEOptions o;
  o.router.experts = kExperts;
  o.router.top_k = kTopK;
  o.router.norm_topk_prob = true;
  o.hidden = kHidden;
  return o;
}

void expert_parallel_against_local(int reps) {
  std::mutex mu;
  hp::testing::run_ranks(2, [&](const hp::comm::ProcessGroup& world) {
    hp::nn::MoEOptions o = layer_options();
    const int64_t tokens = kTokens / 2;  // each rank's
    const at::Tensor x = random({tokens, kDim}, 10 + world.rank());
    double seconds[2] = {0, 0}, compute[2] = {0, 0};
    int64_t measured_bytes = 0, predicted_bytes = 0;
    for (const int ep : {1, 2}) {
      hp::nn::MoE moe(kDim, o);
      if (ep == 2) {
        const hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {2}, {"ep"});
        hp::parallelize_module(moe, mesh, {{"", hp::ExpertParallel()}});
      }
      hp::nn::init_parameters(moe, 4);
      world.barrier();
      seconds[ep - 1] = step_seconds([&](const at::Tensor& r) { return moe(r); }, x, reps);
      // The experts' compute alone, on the rows this rank's experts get.
      std::vector<int64_t> counts = hp::to_host_int64s(moe.router->route(x).counts);
      if (ep == 2) {
        const at::Tensor all = world.all_gather(at::tensor(counts, at::kLong).view({1, -1})).view({2, kExperts});
        counts.assign(kExperts / 2, 0);
        for (int64_t e = 0; e < kExperts / 2; ++e)
          counts[e] = all.select(1, world.rank() * kExperts / 2 + e).sum().item<int64_t>();
      }
      hp::nn::GroupedExperts alone(static_cast<int64_t>(counts.size()), kDim, kHidden);
      hp::nn::init_parameters(alone, 5);
      const int64_t rows = std::accumulate(counts.begin(), counts.end(), int64_t{0});
      compute[ep - 1] =
          step_seconds([&](const at::Tensor& r) { return alone.run(r, counts); }, random({rows, kDim}, 6), reps);
      if (ep == 2) {
        hp::comm::CommDebugMode debug;
        at::NoGradGuard no_grad;
        const hp::nn::Routing routing = moe.router->route(x);
        moe.routed_output(x, routing);
        measured_bytes = debug.bytes("all_to_all");
        // counts (with the 3-element overflow record) to each rank, every row out, every received row back.
        predicted_bytes = 2 * (kExperts / 2 + 3) * 8 + kTokens / 2 * kTopK * kDim * 4 + rows * kDim * 4;
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    if (world.rank() != 0) return;
    std::cout << std::fixed << std::setprecision(2) << "MoE layer step on 2 ranks (" << tokens
              << " tokens each), ep 2 vs ep 1, rank 0, median of " << reps << ":\n  ep 1 " << 1e3 * seconds[0]
              << " ms, ep 2 " << 1e3 * seconds[1] << " ms, time ratio " << std::setprecision(3)
              << seconds[1] / seconds[0] << "; experts' compute alone " << std::setprecision(2) << 1e3 * compute[0]
              << " ms vs " << 1e3 * compute[1] << " ms, compute ratio " << std::setprecision(3)
              << compute[1] / compute[0] << "\n  all_to_all bytes of one forward: " << measured_bytes << ", formula "
              << predicted_bytes << (measured_bytes == predicted_bytes ? " (equal)" : " (DIFFERENT)") << "\n";
  });
}

void shared_experts_overlap(int reps) {
  std::mutex mu;
  hp::testing::run_ranks(2, [&](const hp::comm::ProcessGroup& world) {
    hp::nn::MoEOptions o = layer_options();
    o.shared_hidden = kShared;
    const at::Tensor x = random({kTokens / 2, kDim}, 20 + world.rank());
    const hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {2}, {"ep"});
    const auto layer = [&](bool overlap) {
      hp::nn::MoEOptions with = o;
      with.overlap_shared = overlap;
      auto moe = std::make_shared<hp::nn::MoE>(kDim, with);
      hp::parallelize_module(*moe, mesh, {{"", hp::ExpertParallel()}});
      hp::nn::init_parameters(*moe, 4);
      return moe;
    };
    const auto moe = layer(true);
    // The dispatch of this rank's rows to the expert-parallel ranks, with the layer's splits.
    const std::vector<int64_t> mine = hp::to_host_int64s(moe->router->route(x).counts);
    const at::Tensor all = world.all_gather(at::tensor(mine, at::kLong).view({1, -1})).view({2, 2, kExperts / 2});
    hp::comm::AllToAllOptions splits;
    for (int r = 0; r < 2; ++r) {
      splits.input_split_sizes.push_back(all[world.rank()][r].sum().item<int64_t>());
      splits.output_split_sizes.push_back(all[r][world.rank()].sum().item<int64_t>());
    }
    const at::Tensor rows = random({kTokens / 2 * kTopK, kDim}, 30).requires_grad_(true);
    // What the layer's dispatcher does, timed piece by piece and whole, interleaved so that every
    // iteration sees the same load: the dispatch all_to_all alone, the shared experts alone, the
    // all_to_all issued with the shared experts run before the wait (as the layer does), and the
    // same with a sleep as long as this iteration's shared experts instead of them (a stand-in for
    // an accelerator computing while the host moves the rows).
    const auto timed = [&](const std::function<void()>& fn) {
      world.barrier();
      return hp::bench::seconds(fn);
    };
    std::vector<double> dispatch, shared, hidden, hidden_by_sleep;
    for (int i = 0; i <= 3 * reps; ++i) {
      const double d = timed([&] { hp::comm::functional::all_to_all(rows, world, splits); });
      const double c = timed([&] { (*moe->shared)(x); });
      const double both = timed([&] {
        auto in_flight = hp::comm::functional::all_to_all_async(rows, world, splits);
        (*moe->shared)(x);
        in_flight.wait();
      });
      const double slept = timed([&] {
        auto in_flight = hp::comm::functional::all_to_all_async(rows, world, splits);
        std::this_thread::sleep_for(std::chrono::duration<double>(c));
        in_flight.wait();
      });
      if (i == 0) continue;  // warm-up
      dispatch.push_back(d);
      shared.push_back(c);
      hidden.push_back(d + c - both);
      hidden_by_sleep.push_back(d + c - slept);
    }
    const double d = hp::bench::median(dispatch);
    // The whole layer's forward, with and without the overlap, interleaved.
    const auto serial = layer(false), overlapped = layer(true);
    std::vector<double> forward[2];
    for (int i = 0; i <= reps; ++i)
      for (const bool overlap : {false, true}) {
        const double t = timed([&] { (*(overlap ? overlapped : serial))(x); });
        if (i > 0) forward[overlap].push_back(t);
      }
    std::lock_guard<std::mutex> lock(mu);
    if (world.rank() != 0) return;
    std::cout << std::fixed << std::setprecision(2) << "shared experts (hidden " << kShared
              << ") during the dispatch all_to_all, ep 2 on 2 ranks (" << kTokens / 2
              << " tokens each), forward, rank 0, medians of " << 3 * reps << ":\n  dispatch alone " << 1e3 * d
              << " ms, shared experts alone " << 1e3 * hp::bench::median(shared) << " ms; hidden "
              << 1e3 * hp::bench::median(hidden) << " ms, overlap fraction of the dispatch " << std::setprecision(3)
              << hp::bench::median(hidden) / d << " (target >= 0.8)\n  stand-in, a sleep instead of the shared "
              << "experts: overlap fraction " << hp::bench::median(hidden_by_sleep) / d << std::setprecision(2)
              << "\n  layer forward: serial " << 1e3 * hp::bench::median(forward[0]) << " ms, overlapped "
              << 1e3 * hp::bench::median(forward[1]) << " ms\n";
  });
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int reps = quick ? 2 : 10;
  grouped_against_dense(reps);
  expert_parallel_against_local(reps);
  shared_experts_overlap(reps);
  return 0;
}
