// init_process_group and the launcher environment it reads.
#include "hp/comm/init.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "comm/c10d_shim.h"
#include "comm/world.h"
#include "hp/core/error.h"
#include "hp/core/job.h"
#include "hp/core/store_wire.h"

namespace hp::comm {
namespace {

// Parses the leading integer of a variable ("4(x2)" in SLURM_TASKS_PER_NODE gives 4).
std::optional<int> read_int(const GetEnv& getenv, const char* name, bool leading_only = false) {
  const char* raw = getenv(name);
  if (raw == nullptr || *raw == '\0') return std::nullopt;
  char* end = nullptr;
  const long value = std::strtol(raw, &end, 10);
  HP_CHECK(end != raw && (leading_only || *end == '\0'), "launch environment: ", name, "='", raw,
           "' is not an integer");
  return static_cast<int>(value);
}

struct Scheme {
  const char* source;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;
};

// Launchers in order of preference; the first whose rank variable is set wins.
constexpr Scheme kSchemes[] = {
    {"hprun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
    {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
};

// Opens the job's store file and waits until every rank has opened it: a rank that never comes is
// reported here, by count, rather than later as a peer missing from the first collective.
shim::StorePtr join_file_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  shim::StorePtr store;
  int64_t joined = 0;
  const std::string key = "hp/rendezvous/joined";
  try {
    store = shim::make_file_store(env.rendezvous_file, env.world_size);
    store->setTimeout(timeout);  // c10d's default (5 min) would also bound retries on a missing directory
    joined = store->add(key, 1);
  } catch (const std::exception& e) {
    HP_FAIL("init_process_group: rank ", env.rank, " could not use the rendezvous file ", env.rendezvous_file, " (",
            shim::first_line(e), ")");
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (joined < env.world_size && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    joined = store->add(key, 0);
  }
  if (joined < env.world_size)
    throw TimeoutError(hp::detail::str_cat("init_process_group: rank ", env.rank, ": only ", joined, " of ",
                                           env.world_size, " ranks reached the rendezvous file ", env.rendezvous_file,
                                           " within ", timeout.count(),
                                           " ms. Did every rank start, and do they share HP_RENDEZVOUS_FILE?"));
  return store;
}

}  // namespace

LaunchEnv read_launch_env(const GetEnv& getenv_override) {
  const GetEnv getenv = getenv_override ? getenv_override : [](const char* n) { return std::getenv(n); };
  LaunchEnv env;
  env.source = "default";
  for (const Scheme& s : kSchemes) {
    auto rank = read_int(getenv, s.rank);
    if (!rank) continue;
    auto size = read_int(getenv, s.size);
    HP_CHECK(size, "launch environment: ", s.rank, " is set but ", s.size, " is not");
    env.source = s.source;
    env.rank = *rank;
    env.world_size = *size;
    env.local_rank = read_int(getenv, s.local_rank).value_or(*rank);
    if (env.source == std::string("pmi") && !getenv("MPI_LOCALRANKID"))
      env.local_rank = read_int(getenv, "PMI_LOCAL_RANK").value_or(*rank);
    env.local_world_size = read_int(getenv, s.local_size, /*leading_only=*/true).value_or(*size);
    HP_CHECK(env.world_size > 0, "launch environment: ", s.size, "=", env.world_size, " must be positive");
    HP_CHECK(env.rank >= 0 && env.rank < env.world_size, "launch environment: ", s.rank, "=", env.rank,
             " is not in [0, ", s.size, "=", env.world_size, ")");
    HP_CHECK(env.local_rank >= 0 && env.local_rank < env.local_world_size, "launch environment: local rank ",
             env.local_rank, " (", s.local_rank, ") is not in [0, ", env.local_world_size, ")");
    break;
  }
  if (const char* addr = getenv("MASTER_ADDR"); addr && *addr) env.master_addr = addr;
  env.master_port = read_int(getenv, "MASTER_PORT").value_or(29500);
  if (const char* file = getenv(job::kRendezvousFileEnv); file && *file) env.rendezvous_file = file;
  HP_CHECK(env.master_port > 0 && env.master_port < 65536, "launch environment: MASTER_PORT=", env.master_port,
           " is not a TCP port");
  HP_CHECK(env.world_size == env.local_world_size || getenv("MASTER_ADDR"),
           "launch environment: a job spanning several nodes (WORLD_SIZE ", env.world_size, " > local ",
           env.local_world_size, ") needs MASTER_ADDR set to the host of rank 0");
  return env;
}

ProcessGroup init_process_group(InitOptions options) {
  const LaunchEnv env = options.env ? *options.env : read_launch_env();
  ProcessGroupOptions group = options.group;
  if (group.gloo_hostname.empty() && env.world_size != env.local_world_size) {
    char host[256] = {0};
    HP_CHECK(gethostname(host, sizeof(host) - 1) == 0, "init_process_group: gethostname failed");
    group.gloo_hostname = host;  // reachable from other nodes; loopback is enough on one node
  }
  // A process started without a launcher is a world of one: it needs no rendezvous, and must not
  // claim the default port (two such processes would collide there).
  if (env.world_size == 1 && env.source == "default")
    return create_world_group(shim::make_hash_store(), 0, 1, group, WorldLayout{true, 0});
  const WorldLayout layout{false, env.world_size == env.local_world_size ? 0 : env.local_world_size};
  if (!env.rendezvous_file.empty())
    return create_world_group(join_file_store(env, options.rendezvous_timeout), env.rank, env.world_size, group,
                              layout);
  shim::StorePtr store;
  // hprun's store on node 0, for a job on several nodes: this rank presents the job's secret.
  const char* secret = std::getenv(store_wire::kSecretEnv);
  const bool secret_store = secret != nullptr && *secret != '\0';
  try {
    store = secret_store
                ? shim::make_rendezvous_client(env.master_addr, env.master_port, secret, options.rendezvous_timeout)
                : shim::make_tcp_store(env.master_addr, env.master_port, env.rank == 0, env.world_size,
                                       options.rendezvous_timeout);
  } catch (const std::exception& e) {
    if (secret_store && !shim::says_timed_out(shim::first_line(e)))
      throw Error("init_process_group: rank " + std::to_string(env.rank) + ": " + shim::first_line(e));
    // Every way of not meeting rank 0 in time (refused, unreachable, slow) is a timeout to hp-train.
    throw TimeoutError("init_process_group: rank " + std::to_string(env.rank) + " could not rendezvous at " +
                       env.master_addr + ":" + std::to_string(env.master_port) + " within " +
                       std::to_string(options.rendezvous_timeout.count()) + " ms (" + shim::first_line(e) +
                       "). Is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?");
  }
  return create_world_group(std::move(store), env.rank, env.world_size, group, layout);
}

InProcessRendezvous::InProcessRendezvous() : store_(std::make_shared<shim::StorePtr>(shim::make_hash_store())) {}

ProcessGroup InProcessRendezvous::join(int rank, int world_size, const ProcessGroupOptions& options) const {
  return create_world_group(*std::static_pointer_cast<shim::StorePtr>(store_), rank, world_size, options,
                            WorldLayout{true, 0});
}

}  // namespace hp::comm
