// Starting a distributed job: reading the launcher's environment and creating the world group.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "hp/comm/process_group.h"

namespace hp::comm {

// Where this process sits in the job, as the launcher described it.
struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // HP_RENDEZVOUS_FILE (set by hprun on one node): the ranks meet in this store file instead of a
  // TCPStore at MASTER_ADDR:MASTER_PORT.
  std::string rendezvous_file;
  std::string source;  // which launcher's variables were read: "hprun", "mpirun", "pmi", "slurm", "default"
};

using GetEnv = std::function<const char*(const char*)>;

// Reads, in this order of preference:
//   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE       (hprun, torchrun)
//   OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}    (Open MPI's mpirun)
//   PMI_RANK, PMI_SIZE, MPI_LOCALRANKID / PMI_LOCAL_RANK  (MPICH / Intel MPI)
//   SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID            (srun)
// plus MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500) and HP_RENDEZVOUS_FILE. With
// none of them set the process is a world of one. Malformed or inconsistent values throw hp::Error naming the variable.
LaunchEnv read_launch_env(const GetEnv& getenv = {});

struct InitOptions {
  ProcessGroupOptions group;
  std::optional<LaunchEnv> env;  // default: read_launch_env()
  // How long the ranks wait for each other at the store (the store file, or rank 0's TCPStore).
  std::chrono::milliseconds rendezvous_timeout{std::chrono::minutes(5)};
};

// Rendezvous through the store file of env.rendezvous_file, or else a TCPStore hosted by rank 0 at
// MASTER_ADDR:MASTER_PORT, and create the world group (Gloo). Every rank must call it once. Nothing is stored globally:
// keep the returned group.
ProcessGroup init_process_group(InitOptions options = {});

// A world of `world_size` ranks in which this process plays `rank` alone, for dry runs
// (hp::train::dry_run): its groups (new_group, DeviceMesh) are made without peers, and its
// collectives move no data and return at once, counted by CommDebugMode like real ones. Outputs
// have the shape, dtype and device a real world gives them. Meta tensors are accepted and stay
// meta. A tensor with values gets what a symmetric world would give it, one where every rank
// contributes what this rank contributes: a sum is the group size times this rank's tensor, avg,
// max, min and broadcast leave it as it is, all_gather repeats it (zeros for pieces of another
// size), reduce_scatter gives the sum's piece, all_to_all delivers this rank's own piece from
// every rank (zeros for pieces of another size); a receive leaves its tensor as it was, unless
// the world shares a FakeExchange with the peer's. Its store is this process's own, in memory.
class FakeExchange;
ProcessGroup fake_world(int world_size, int rank, ProcessGroupOptions options = {},
                        std::shared_ptr<FakeExchange> exchange = nullptr);

// The messages between fake worlds that play different ranks of one world on threads of this
// process (a pipeline's dry run plays one rank per stage, which learn their inputs' shapes from each
// other). A send of a tensor with values leaves a copy here, and the matching receive (same group,
// peers and tag, the same sizes and dtype) of a tensor with values waits for it where it is posted
// (recv_async, batch_isend_irecv), up to the group's timeout: post such a receive after whatever
// the peer's send waits for. Meta tensors move nothing, as without an exchange.
class FakeExchange {
 public:
  FakeExchange();
  ~FakeExchange();
  FakeExchange(const FakeExchange&) = delete;
  FakeExchange& operator=(const FakeExchange&) = delete;

  // Fails every receive waiting here, and every later one, with `why` (a peer's simulation failed,
  // and nothing it would have sent will come).
  void abort(const std::string& why);

  struct State;  // comm/fake_exchange.h
  State& state() const { return *state_; }

 private:
  std::unique_ptr<State> state_;
};
// Whether `group` is of a fake world: what a real group learns from its peers' values must be
// found another way there.
bool is_fake(const ProcessGroup& group);

// A rendezvous for ranks that are threads of this one process (the in-process test harness,
// hp::testing::run_ranks): an in-memory store they share. Each thread calls join with its own rank;
// every rank of the world must join, each once.
class InProcessRendezvous {
 public:
  InProcessRendezvous();
  // Creates this rank's world group (Gloo over loopback) once every rank has joined.
  ProcessGroup join(int rank, int world_size, const ProcessGroupOptions& options = {}) const;

 private:
  std::shared_ptr<void> store_;  // the shared in-memory store (a c10d store, kept opaque here)
};

}  // namespace hp::comm
