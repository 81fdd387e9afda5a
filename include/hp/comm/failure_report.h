// How a failed collective names its missing ranks: its members record "I reached collective #n"
// in the group's store and look for each other's records for a short window. A collective's
// failure is therefore reported within the group's timeout + this window (at most the timeout
// again, for groups with shorter timeouts). Timeouts above the collectives' (a watchdog) must
// leave room for it.
#pragma once

#include <chrono>

namespace hp::comm {

inline constexpr std::chrono::seconds kFailureReportWindow{2};

}  // namespace hp::comm
