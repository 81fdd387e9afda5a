// The program hp_e2e_tests starts under hprun. argv[1] picks the scenario:
//   allreduce   every rank all_reduces rank+1 and checks the sum
//   exit3       rank 1 exits with code 3 after rendezvous; the others wait in a barrier forever
//   peer_dies   rank 1 exits (code 0) after rendezvous; rank 0 then all_reduces with it
//   peer_hangs  rank 1 sleeps; rank 0 all_reduces with a 3 s timeout
//   user_yaml   runs at::frac on a DTensor, which only a rule file in $HP_OPS_YAML_DIR declares
#include <hp/hp.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <chrono>
#include <iostream>
#include <string>
#include <thread>

int main(int argc, char** argv) try {
  const std::string scenario = argc > 1 ? argv[1] : "";
  hp::comm::InitOptions options;
  options.group.set_timeout(scenario == "exit3" ? std::chrono::minutes(5) : std::chrono::seconds(3));
  options.rendezvous_timeout = std::chrono::seconds(30);
  hp::comm::ProcessGroup world = hp::comm::init_process_group(options);
  const int rank = world.rank(), n = world.size();

  if (scenario == "allreduce") {
    const auto sum = world.all_reduce(at::full({4}, rank + 1.0)).sum().item<double>();
    const double want = 4.0 * n * (n + 1) / 2;
    std::cout << "allreduce sum " << sum << (sum == want ? " ok" : " WRONG") << std::endl;
    return sum == want ? 0 : 1;
  }
  if (scenario == "exit3") {
    world.barrier();
    if (rank == 1) std::_Exit(3);
    world.barrier();  // never completes: rank 1 is gone and the timeout is long
    return 0;
  }
  if (scenario == "peer_dies" || scenario == "peer_hangs") {
    world.barrier();
    if (rank == 1) {
      if (scenario == "peer_hangs") std::this_thread::sleep_for(std::chrono::seconds(60));
      std::_Exit(0);  // without a goodbye
    }
    world.all_reduce(at::ones({16}));
    std::cout << "all_reduce unexpectedly completed" << std::endl;
    return 0;
  }
  if (scenario == "user_yaml") {
    hp::DeviceMesh mesh = hp::init_device_mesh(world, "cpu", {n}, {"x"});
    const at::Tensor full = at::arange(12, at::kFloat).div(5.0).view({4, 3});
    const at::Tensor got = hp::DTensor(at::frac(hp::distribute_tensor(full, mesh, {hp::Shard(0)}))).full_tensor();
    const bool ok = at::equal(got, at::frac(full));
    std::cout << "frac through a user rule " << (ok ? "ok" : "WRONG") << std::endl;
    return ok ? 0 : 1;
  }
  std::cerr << "unknown scenario '" << scenario << "'" << std::endl;
  return 2;
} catch (const hp::TimeoutError& e) {
  std::cerr << "TimeoutError: " << e.what() << std::endl;
  return 1;
} catch (const std::exception& e) {
  std::cerr << "Error: " << e.what() << std::endl;
  return 1;
}
