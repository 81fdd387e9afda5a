// Symmetric memory that a group keeps for itself (the workspace of its fused ops,
// comm/fused_matmul.cpp, held by its GroupImpl). Unlike SymmetricMemory::allocate's, it does not
// keep the group alive, which would make a cycle: the group destroys it first.
#pragma once

#include <cstdint>
#include <memory>

#include "hp/comm/symmetric_memory.h"

namespace hp::comm::detail {

struct SymmetricAccess {
  static std::shared_ptr<SymmetricState> allocate_state(const ProcessGroup& group, int64_t bytes, int channels,
                                                        bool keep_group_alive);
  // Collective, as SymmetricMemory::allocate.
  static SymmetricMemory allocate_held_by_group(const ProcessGroup& group, int64_t bytes, int channels);
};

}  // namespace hp::comm::detail
