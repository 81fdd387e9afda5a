// Memory that every member of a group maps: what the shared-memory transport stands on.
//
// Between processes it is a POSIX shared-memory object. Group rank 0 creates it under a name of
// 128 random bits, passed to the other members through the group's store (which only the job can
// read), with mode 0600 and its pages reserved up front, so a full /dev/shm is an error here and
// never a SIGBUS later. Rank 0 unlinks it as soon as every member has mapped it: from then on no
// other process can attach, and the memory goes with the last mapping however the job ends.
// Under hprun the name starts with the job's prefix (hp::job::shm_prefix), and hprun removes what
// a rank killed inside that short window leaves behind.
//
// Between ranks that are threads of one process it is plain anonymous memory, handed from rank 0
// to the others through a process-wide table under such a name, and taken out of the table once
// every member has it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hp::comm::detail {

struct GroupImpl;

// Layout helpers for what lies in a segment.
constexpr int64_t kCacheLine = 64;
inline int64_t round_up(int64_t bytes, int64_t to) { return (bytes + to - 1) / to * to; }

// The value group rank `owner` sets under `key` in the group's store, waited for up to the group's
// timeout; after it, hp::TimeoutError naming `owner` (`what`: the operation, for the message).
std::string await_string(GroupImpl& group, const std::string& key, int owner, const char* what);
// Collective over `group`, through its store: every member's `mine`, in group rank order, under
// keys `keys` + rank (a prefix of the caller's own, used once). A member that does not arrive
// within the group's timeout makes the others throw hp::TimeoutError naming it (a member that
// arrives later than that may still go on: each member waits on its own clock).
std::vector<std::string> exchange_strings(GroupImpl& group, const std::string& keys, const std::string& mine,
                                          const char* what);

enum class SegmentScope {
  kProcess,  // every member is a thread of this process
  kHost,     // the members are processes on this host
};

class SharedSegment {
 public:
  // Collective over the members of `group`, through its store: each member either maps the same
  // zeroed `bytes`, or gets an empty segment and the reason. All members see the same outcome,
  // unless a member gives up waiting for a late one: it throws hp::TimeoutError naming the late
  // member (only the store can fail: a member never arrives within the group's timeout), and
  // members that did not wait as long may go on.
  // `keys`: the prefix of the store keys it uses, one of its own for each segment of a group.
  struct Outcome {
    std::shared_ptr<SharedSegment> segment;
    std::string error;
    // The failure was that the memory could not be reserved or mapped (a full /dev/shm, a quota, a
    // file-size cap where SIGXFSZ is ignored, no memory left), not a misconfiguration; every
    // member agrees.
    bool no_room = false;
  };
  static Outcome create(GroupImpl& group, int64_t bytes, SegmentScope scope, const std::string& keys = "hp_shm/");

  std::byte* data() const { return static_cast<std::byte*>(memory_.get()); }
  int64_t size() const { return size_; }

  SharedSegment(std::shared_ptr<void> memory, int64_t size) : memory_(std::move(memory)), size_(size) {}

 private:
  std::shared_ptr<void> memory_;  // unmapped with the last holder
  int64_t size_;
};

}  // namespace hp::comm::detail
