// Ranks as threads that meet as processes do (one store, a host layout of their own), so that
// groups on one "host" map POSIX segments as between processes, and groups across "hosts" share no
// memory: for the tests of the shared-memory transport and of symmetric memory.
#pragma once

#include <dirent.h>
#include <hp/comm/process_group.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/c10d_shim.h"
#include "comm/world.h"

namespace hp::test {

// The job's segments in /dev/shm (none outside hprun-style set-up, once every member has mapped).
inline std::vector<std::string> segments_named(const std::string& prefix) {
  std::vector<std::string> found;
  DIR* dir = opendir("/dev/shm");
  for (dirent* e; dir != nullptr && (e = readdir(dir)) != nullptr;)
    if (std::string(e->d_name).rfind(prefix, 0) == 0) found.push_back(e->d_name);
  if (dir != nullptr) closedir(dir);
  return found;
}

// What one rank launches with: its options (transport, timeout) and its host layout.
struct Launch {
  comm::ProcessGroupOptions options;
  comm::WorldLayout layout;
};

// Runs fn(world) on `n` threads, each a rank of a world that meets through one store as processes
// do, launched as launch_of(rank) says. Returns each rank's error, empty where fn returned.
inline std::vector<std::string> run_as_processes(int n, const std::function<Launch(int)>& launch_of,
                                                 const std::function<void(const comm::ProcessGroup&)>& fn) {
  auto store = comm::shim::make_hash_store();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(n);
  for (int rank = 0; rank < n; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        const Launch launch = launch_of(rank);
        fn(comm::create_world_group(store, rank, n, launch.options, launch.layout));
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

// The same launch on every rank, `ranks_per_host` to a host (so groups on one host map POSIX
// segments, as between processes).
inline std::vector<std::string> run_as_processes(int n, const comm::ProcessGroupOptions& options, int ranks_per_host,
                                                 const std::function<void(const comm::ProcessGroup&)>& fn) {
  return run_as_processes(
      n,
      [&](int) {
        return Launch{options, comm::WorldLayout{false, ranks_per_host}};
      },
      fn);
}

}  // namespace hp::test
