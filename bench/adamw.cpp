// bench/adamw: one optimizer step on the demo model's FSDP shards (2 ranks): torch::optim::AdamW
// (about 10 DTensor ops per parameter, each through DTensor dispatch) versus hp::AdamW's foreach
// path on the local pieces, alternating in one run.
//
//   build/bin/bench_adamw [--quick]
#include <ATen/ATen.h>

#include <cstring>
#include <iomanip>
#include <iostream>
#include <mutex>

#include "bench/timing.h"
#include "hp/models/llama/parallelize.h"
#include "hp/nn/init.h"
#include "hp/optim/adamw.h"
#include "hp/testing/run_ranks.h"

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int steps = quick ? 3 : 20;
  hp::models::LlamaConfig c{256, 256, 4, 8, 4, 768, 128};  // examples/tiny_llama.yaml
  double torch_s = 0, foreach_s = 0;
  std::mutex mu;
  hp::testing::run_ranks(2, [&](const hp::comm::ProcessGroup& world) {
    hp::ParallelDims dims;
    dims.dp_shard = 2;
    hp::models::Llama model(c);
    hp::models::parallelize_llama(model, hp::build_mesh(world, dims), dims);
    hp::nn::init_parameters(model, 1);
    for (auto& p : model.parameters()) p.mutable_grad() = p.detach().mul(0.01);
    const auto options = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
    torch::optim::AdamW reference(model.parameters(), options);
    hp::AdamW fast(model.parameters(), options);
    std::vector<double> a, b;
    for (int i = 0; i < steps; ++i) {
      a.push_back(hp::bench::seconds([&] { reference.step(); }));
      b.push_back(hp::bench::seconds([&] { fast.step(); }));
    }
    std::lock_guard<std::mutex> lock(mu);
    if (world.rank() == 0) torch_s = hp::bench::median(a), foreach_s = hp::bench::median(b);
  });
  std::cout << std::fixed << std::setprecision(2) << "bench_adamw: demo model (" << c.parameter_count()
            << " parameters), FSDP on 2 ranks, median of " << steps << " steps\n  torch::optim::AdamW " << 1e3 * torch_s
            << " ms, hp::AdamW (foreach on local shards) " << 1e3 * foreach_s << " ms, ratio " << std::setprecision(3)
            << foreach_s / torch_s << "\n";
  return 0;
}
