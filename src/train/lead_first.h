// Start-up work that rank 0 does alone while the others wait: preparing the data cache, measuring
// the machine's peak. It takes as long as it takes (a large corpus: minutes), which is not what the
// collective timeout bounds (a peer that is stuck), so the others wait on the store instead of in a
// barrier, up to the longer of that timeout and kLeadFirstWait. When rank 0's work fails, the
// others fail at once with its message.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "hp/comm/process_group.h"

namespace hp::train::detail {

inline constexpr std::chrono::minutes kLeadFirstWait{30};

// Collective over `world`: rank 0 runs `work` (named by `what`, e.g. "preparing the data"); every
// rank returns once it has finished.
void lead_first(const comm::ProcessGroup& world, const std::string& what, const std::function<void()>& work);

}  // namespace hp::train::detail
