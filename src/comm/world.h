// Creating the world group from a store the caller already has (init_process_group uses a
// store file or a TCPStore; the in-process test harness a shared in-memory HashStore).
#pragma once

#include "comm/c10d_shim.h"
#include "hp/comm/process_group.h"

namespace hp::comm {

// Where the ranks of a world run, for the shared-memory transport: all as threads of this process,
// all on this host (ranks_per_host 0), or on hosts of `ranks_per_host` consecutive world ranks.
struct WorldLayout {
  bool one_process = false;
  int ranks_per_host = 0;
};

ProcessGroup create_world_group(shim::StorePtr store, int rank, int world_size, ProcessGroupOptions options,
                                WorldLayout layout);

}  // namespace hp::comm
