// Symmetric memory that a group keeps for itself (the workspace of its fused ops,
// comm/fused_matmul.cpp, held by its GroupImpl). Unlike SymmetricMemory::allocate's, it does not
// keep the group alive, which would make a cycle: the group destroys it first.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "hp/comm/symmetric_memory.h"

namespace hp::comm::detail {

struct SymmetricAccess {
  // `no_room`: where the segment could not be reserved (SharedSegment::Outcome::no_room: a full
  // /dev/shm, no memory left), returns nullptr and says why there instead of throwing; nullptr:
  // throws.
  static std::shared_ptr<SymmetricState> allocate_state(const ProcessGroup& group, int64_t bytes, int channels,
                                                        bool keep_group_alive, std::string* no_room = nullptr);
  // Collective, as SymmetricMemory::allocate, except that memory there is no room for is no error:
  // every member alike gets std::nullopt, and `no_room` says why. Any other failure (members that
  // ask for other sizes, a member that never comes, a segment a member cannot open) throws.
  static std::optional<SymmetricMemory> allocate_held_by_group(const ProcessGroup& group, int64_t bytes, int channels,
                                                               std::string& no_room);
};

}  // namespace hp::comm::detail
