#include "hp/comm/leave.h"

#include <memory>
#include <mutex>
#include <vector>

#include "comm/group_impl.h"
#include "comm/shm_channel.h"

namespace hp::comm {

uint64_t collective_failures(const ProcessGroup& world) {
  const auto registry = world.impl().registry.lock();
  return registry ? registry->failures.load(std::memory_order_acquire) : 0;
}

void note_failure_of_another_rank(const ProcessGroup& group) { group.impl().note_failure(); }

void leave_groups(const ProcessGroup& world) {
  const auto registry = world.impl().registry.lock();
  if (!registry) return;
  std::vector<std::shared_ptr<detail::GroupImpl>> groups;
  {
    std::lock_guard<std::mutex> lock(registry->mu);
    if (auto whole = registry->world.lock()) groups.push_back(std::move(whole));
    for (const auto& [ranks, group] : registry->groups) groups.push_back(group);
  }
  for (const auto& group : groups)
    if (group->shm) group->shm->leave();
}

}  // namespace hp::comm
