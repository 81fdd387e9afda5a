// Giving up on a world after an error: what hp-train's last words after an error use
// (docs/resilience.md#last-words-after-an-error).
#pragma once

#include <cstdint>

#include "hp/comm/process_group.h"

namespace hp::comm {

// How many collectives, sends and receives of this rank on `world`, or on groups made from it, have
// failed so far (with the failures noted below): an error that follows such a failure is a
// consequence of another rank's, not its cause.
uint64_t collective_failures(const ProcessGroup& world);

// Counts a failure of this rank on `group` that a protocol outside the collectives found (a
// pipeline's failure notice: another rank failed, so this one stops).
void note_failure_of_another_rank(const ProcessGroup& group);

// This rank gives up on `world` and every group made from it, for good. Members waiting for it in a
// collective of host tensors on shared memory fail at once, naming it as having left, and its own
// later collectives on those groups fail. Collectives on Gloo (comm.transport gloo, ranks on
// different hosts, GPU tensors) cannot be left this way: their members find out when they time
// out. The store stays usable.
void leave_groups(const ProcessGroup& world);

}  // namespace hp::comm
