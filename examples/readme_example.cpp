// The README's 20-line example, kept compiling and running (ctest runs it on 4 ranks).
#include <hp/hp.h>
#include <torch/torch.h>
#include <iostream>

int main() {
  // Reads RANK, WORLD_SIZE, MASTER_ADDR, ... (set by hprun, mpirun or srun); rendezvous via TCPStore.
  hp::comm::ProcessGroup world = hp::comm::init_process_group();
  hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {2, 2}, {"dp", "tp"});

  const hp::comm::ProcessGroup& tp = mesh.get_group("tp");
  at::Tensor x = torch::full({4}, world.rank() + 1.0);
  tp.all_reduce(x);                                  // in place, sum over the tp group
  at::Tensor rows = tp.all_gather(x.view({1, 4}));   // (2, 4): one row per tp rank
  hp::comm::Work w = mesh.get_group("dp").reduce_scatter_async(rows);
  at::Tensor mine = w.wait();                        // this rank's row of the dp sum

  std::cout << "rank " << world.rank() << " at " << mesh.get_coordinate()->at(0) << ","
            << mesh.get_local_rank("tp") << " has " << mine << "\n";
}
