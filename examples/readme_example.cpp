#include <hp/hp.h>
#include <torch/torch.h>
#include <iostream>

// The model is written once and knows nothing about parallelism.
struct Mlp : hp::nn::Module {
  Mlp() : hp::nn::Module("Mlp") {}
  std::shared_ptr<hp::nn::Linear> up = add_module("up", std::make_shared<hp::nn::Linear>(16, 64));
  std::shared_ptr<hp::nn::Linear> down = add_module("down", std::make_shared<hp::nn::Linear>(64, 16));
  at::Tensor forward(const at::Tensor& x) override { return (*down)(at::relu((*up)(x))); }
};

int main() {
  hp::comm::ProcessGroup world = hp::comm::init_process_group();  // RANK, WORLD_SIZE, ... from hprun
  hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {world.size()}, {"tp"});
  Mlp model;  // shapes only, no storage yet
  hp::parallelize_module(model, mesh, {{"up", hp::ColwiseParallel()}, {"down", hp::RowwiseParallel()}});
  hp::nn::init_parameters(model, /*seed=*/0);  // each rank fills only its shards
  torch::optim::AdamW optimizer(model.parameters(), torch::optim::AdamWOptions(1e-2));
  const at::Tensor x = torch::linspace(-1, 1, 8 * 16).view({8, 16});
  for (int step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    at::Tensor loss = (model(x) - x).pow(2).mean();  // same value on every rank
    loss.backward();
    optimizer.step();
    if (world.rank() == 0) std::cout << "step " << step << " loss " << loss.item<float>() << "\n";
  }
}
