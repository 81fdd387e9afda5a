// The program hp_e2e_tests starts under hprun. argv[1] picks the scenario:
//   allreduce   every rank all_reduces rank+1 and checks the sum
//   exit3       rank 1 exits with code 3 after rendezvous; the others wait in a barrier forever
//   peer_dies   rank 1 exits (code 0) after rendezvous; rank 0 then all_reduces with it
//   peer_hangs  rank 1 sleeps; rank 0 all_reduces with a 3 s timeout
//   user_yaml   runs at::frac on a DTensor, which only a rule file in $HP_OPS_YAML_DIR declares
//   listeners   every rank lists the TCP sockets it listens on; any outside loopback fails it
//   collectives deterministic all_reduce, all_gather, reduce_scatter, all_to_all and broadcast from
//               empty to several MB, and all_reduce and reduce_scatter on bf16 and fp8 wires, each
//               checked bitwise against the same computed on this rank;
//               says which transport the world group used (a mapped /dev/shm segment or not)
//   shm_killed  after a collective, rank 1 leaves a segment of the job in /dev/shm, as a rank
//               killed while its group was being set up would, and is SIGKILLed
//   symmetric   a ring of puts and signals through symmetric memory, checked on every rank; then
//               rank 1 exits (code 0, no goodbye) while rank 0 waits for its signal
//   restart     the first attempt (HP_RESTART_COUNT 0) leaves a key in the store and rank 1 exits
//               with code 3; a later attempt checks the key is gone (a fresh rendezvous), all_reduces
#include <dirent.h>
#include <fcntl.h>
#include <hp/core/job.h>
#include <hp/hp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// The inodes of this process's sockets.
std::set<std::string> own_socket_inodes() {
  std::set<std::string> inodes;
  DIR* fds = opendir("/proc/self/fd");
  for (dirent* e; fds != nullptr && (e = readdir(fds)) != nullptr;) {
    char target[256] = {0};
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
    const std::string t(target, n > 0 ? n : 0);
    if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
  }
  if (fds != nullptr) closedir(fds);
  return inodes;
}

// An address of /proc/net/tcp{,6} (hex, as the kernel stores it) is loopback: 127.0.0.0/8, ::1 or
// ::ffff:127.x.
bool is_loopback(const std::string& hex_address) {
  if (hex_address.size() == 8) return hex_address.substr(6, 2) == "7F";
  return hex_address == "00000000000000000000000001000000" ||
         (hex_address.substr(0, 24) == "0000000000000000FFFF0000" && hex_address.substr(30, 2) == "7F");
}

// "tcp 00000000:9C41" for each socket of this process in LISTEN state on a non-loopback address.
std::vector<std::string> outside_listeners() {
  const std::set<std::string> mine = own_socket_inodes();
  std::vector<std::string> found;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state != "0A" || !mine.count(inode)) continue;
      if (!is_loopback(local.substr(0, local.find(':')))) found.push_back(std::string(table) + " " + local);
    }
  }
  return found;
}

// Whether this process maps a shared-memory segment of the job (unlinked once every rank mapped it).
bool maps_job_segment() {
  std::ifstream maps("/proc/self/maps");
  const std::string segment = "/dev/shm/" + hp::job::shm_prefix();
  for (std::string line; std::getline(maps, line);)
    if (line.find(segment) != std::string::npos) return true;
  return false;
}

// Whether `p` lies in a shared-memory segment of the job that this process maps.
bool in_job_segment(const void* p) {
  std::ifstream maps("/proc/self/maps");
  const std::string segment = "/dev/shm/" + hp::job::shm_prefix();
  const auto address = reinterpret_cast<uintptr_t>(p);
  for (std::string line; std::getline(maps, line);) {
    if (line.find(segment) == std::string::npos) continue;
    const size_t dash = line.find('-'), space = line.find(' ');
    const uintptr_t begin = std::stoull(line.substr(0, dash), nullptr, 16);
    const uintptr_t end = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
    if (address >= begin && address < end) return true;
  }
  return false;
}

// Every rank's input, known to every rank.
at::Tensor input_of(int rank, int64_t numel, int salt) {
  return at::randn({numel}, at::make_generator<at::CPUGeneratorImpl>(100 * salt + rank));
}

bool check_collectives(const hp::comm::ProcessGroup& world) {
  const int rank = world.rank(), n = world.size();
  bool ok = true;
  auto check = [&](const std::string& what, const at::Tensor& got, const at::Tensor& want) {
    if (at::equal(got, want)) return;
    std::cout << what << " WRONG" << std::endl;
    ok = false;
  };
  int salt = 0;
  for (int64_t numel : {int64_t{0}, int64_t{1000} * n, int64_t{3} << 20}) {
    std::vector<at::Tensor> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(input_of(r, numel, salt));
    ++salt;
    const at::Tensor sum = hp::comm::tree_reduce(at::stack(inputs), hp::comm::ReduceOp::kSum);
    const std::string size = " of " + std::to_string(numel) + " floats";
    check("all_reduce" + size, world.all_reduce(inputs[rank].clone()), sum);
    check("reduce_scatter" + size, world.reduce_scatter(inputs[rank]), sum.chunk(n)[rank]);
    check("all_gather" + size, world.all_gather(inputs[rank]), at::cat(inputs));
    std::vector<at::Tensor> mine;
    for (int r = 0; r < n; ++r) mine.push_back(inputs[r].chunk(n)[rank]);
    check("all_to_all" + size, world.all_to_all(inputs[rank]), at::cat(mine));
    check("broadcast" + size, world.broadcast(inputs[rank].clone(), n - 1), inputs[n - 1]);
    for (hp::comm::WireFormat wire : {hp::comm::WireFormat::kBf16, hp::comm::WireFormat::kFp8E4M3}) {
      std::vector<at::Tensor> received;  // what the members add: each piece rounded on its own
      for (const at::Tensor& input : inputs) {
        std::vector<at::Tensor> pieces;
        for (const at::Tensor& piece : input.chunk(n)) pieces.push_back(hp::comm::wire_round_trip(piece, wire));
        received.push_back(numel == 0 ? input : at::cat(pieces));
      }
      const at::Tensor rounded_sum = hp::comm::tree_reduce(at::stack(received), hp::comm::ReduceOp::kSum);
      const std::string on_wire = size + " on a " + hp::comm::to_string(wire) + " wire";
      check("all_reduce" + on_wire, world.all_reduce(inputs[rank].clone(), {hp::comm::ReduceOp::kSum, wire}),
            rounded_sum);
      hp::comm::ReduceScatterOptions rs;
      rs.wire = wire;
      check("reduce_scatter" + on_wire, world.reduce_scatter(inputs[rank], rs), rounded_sum.chunk(n)[rank]);
    }
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string scenario = argc > 1 ? argv[1] : "";
  hp::comm::InitOptions options;
  options.group.set_timeout(scenario == "exit3" ? std::chrono::minutes(5) : std::chrono::seconds(3));
  options.group.set_deterministic(scenario == "collectives");
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
  if (scenario == "listeners") {
    world.barrier();  // every rank's store connection and Gloo pairs are up
    const std::vector<std::string> outside = outside_listeners();
    for (const std::string& l : outside) std::cout << "listening outside loopback: " << l << std::endl;
    world.barrier();  // rank 0's listeners stay up until every rank has looked
    if (outside.empty()) std::cout << "listens on loopback only" << std::endl;
    return outside.empty() ? 0 : 1;
  }
  if (scenario == "collectives") {
    const bool ok = check_collectives(world);
    std::cout << "collectives " << (ok ? "ok" : "WRONG") << " over " << (maps_job_segment() ? "shared memory" : "gloo")
              << std::endl;
    return ok ? 0 : 1;
  }
  if (scenario == "shm_killed") {
    world.barrier();
    if (rank == 1) {
      const std::string name = "/" + hp::job::shm_prefix() + "left-by-a-killed-rank";
      const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
      std::cout << "left " << name << (fd >= 0 ? "" : " FAILED") << std::endl;
      raise(SIGKILL);
    }
    world.barrier();  // fails: rank 1 is gone
    return 0;
  }
  if (scenario == "symmetric") {
    hp::comm::SymmetricMemory memory = hp::comm::SymmetricMemory::allocate(world, 1 << 20, 2);
    const int next = (rank + 1) % n, previous = (rank + n - 1) % n;
    bool ok = true;
    for (int k = 0; k < 50; ++k) {
      const int64_t place = (k % 2) * (1 << 19);
      if (k >= 2) memory.wait_signal(next, 1);  // `next` has read the place this rank reuses
      memory.put(at::full({1 << 17}, 1000.0 * rank + k), next, place);
      memory.put_signal(next);
      memory.wait_signal(previous);
      ok = ok &&
           at::equal(memory.buffer(rank, at::kFloat, {1 << 17}, place), at::full({1 << 17}, 1000.0 * previous + k));
      memory.put_signal(previous, 1);
    }
    memory.barrier();
    const bool shared = in_job_segment(memory.buffer(next, at::kFloat, {1}).data_ptr());
    std::cout << "symmetric ring " << (ok ? "ok" : "WRONG") << " over " << (shared ? "a segment" : "private memory")
              << std::endl;
    if (rank == 1) std::_Exit(0);  // without a goodbye
    if (rank == 0) memory.wait_signal(1);
    return 0;
  }
  if (scenario == "restart") {
    const char* restarts = std::getenv("HP_RESTART_COUNT");
    const hp::comm::GroupStore store = world.store();
    if (restarts == nullptr || std::string(restarts) == "0") {
      store.set("left_by_the_first_attempt", "");
      world.barrier();
      if (rank == 1) std::_Exit(3);
      world.barrier();  // never completes
      return 0;
    }
    const bool fresh = !store.check("left_by_the_first_attempt");
    const auto sum = world.all_reduce(at::full({4}, 1.0)).sum().item<double>();
    std::cout << "restart " << restarts << (fresh ? " fresh rendezvous" : " STALE rendezvous") << " sum " << sum
              << std::endl;
    return fresh && sum == 4.0 * n ? 0 : 1;
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
