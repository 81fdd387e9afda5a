// Creating the world group from a store the caller already has (init_process_group uses a
// store file or a TCPStore; the in-process test harness a shared in-memory HashStore).
#pragma once

#include "comm/c10d_shim.h"
#include "hp/comm/process_group.h"

namespace hp::comm {

ProcessGroup create_world_group(shim::StorePtr store, int rank, int world_size, ProcessGroupOptions options);

}  // namespace hp::comm
