// Giving up on a world after an error: what hp-train's last words after an error use
// (docs/resilience.md#last-words).
#pragma once

#include "hp/comm/process_group.h"

namespace hp::comm {

// Whether a collective, send or receive of this rank on `world`, or on a group made from it, has
// failed: an error that follows such a failure is a consequence of another rank's, not its cause.
bool collective_failed(const ProcessGroup& world);

// This rank gives up on `world` and every group made from it, for good. Members waiting for it in a
// collective on shared memory fail at once, naming it as having left, and its own later collectives
// on those groups fail. A group on Gloo (comm.transport gloo, or ranks on different hosts) cannot
// be left this way: its members find out when their collective times out. The store stays usable.
void leave_groups(const ProcessGroup& world);

}  // namespace hp::comm
