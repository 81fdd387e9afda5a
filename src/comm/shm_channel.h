// The shared-memory transport of one group: a SharedSegment laid out as a control block and, per
// member, two send slots, and the three ways the collectives use it.
//
// Every operation is a sequence of rounds. In a round each member copies (a chunk of) what it sends
// into its own slot, all members meet in a barrier, and each copies what it receives out of the
// senders' slots. Rounds alternate between a member's two slots, so a member may write round k+1
// while slower members still read round k: a member writes round k+2 into the slot of round k only
// after the barrier of round k+1, which nobody reaches before having read round k. The parity runs
// on across operations, so the same holds from one collective to the next.
//
// The first round of an operation also carries each member's send sizes, so that every member
// knows how many rounds the largest message needs, and each receiver checks that what is sent to
// it is what it expects, and which collective each member runs (name and sequence number), so
// that members whose programs diverged fail the collective instead of corrupting the output.
//
// The barrier is a counter of arrivals and a futex word of completed rounds: a short spin, then a
// futex wait in slices, checking between slices for members that failed, left (their group was
// destroyed) or whose process is gone, and for the group's timeout. A failure marks the channel for
// every member, so no later collective on it can run on half-written data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/shared_segment.h"

namespace hp::comm::detail {

struct CollectiveSite;
struct GroupImpl;

struct ByteSpan {
  std::byte* data = nullptr;
  int64_t size = 0;
};

class ShmChannel {
 public:
  // Collective over `group` (see SharedSegment::create). Returns nullptr and says why in `error`
  // when the members cannot share memory; every member gets the same answer.
  static std::shared_ptr<ShmChannel> open(GroupImpl& group, SegmentScope scope, std::string* error);
  ~ShmChannel();  // leave()
  // Tells the other members this one has left for good: those waiting for it fail at once, and
  // this member's own later operations on the channel fail.
  void leave();

  // All to all: sends[j] goes to member j, recvs[i] receives member i's bytes (of the size member
  // i sends to this one).
  void exchange(const CollectiveSite& site, const std::vector<ByteSpan>& sends, const std::vector<ByteSpan>& recvs);
  // All to all where every member sends this one `receive_bytes`, handed over where they lie:
  // each round calls consume(received, offset), received[i] being the chunk member i sent (this
  // member's own included) and `offset` its place in the whole message. `consume` may write into
  // the received chunks: nobody else reads them. Reductions read the pieces without a copy.
  using Consume = std::function<void(const std::vector<ByteSpan>& received, int64_t offset)>;
  void exchange_and_consume(const CollectiveSite& site, const std::vector<ByteSpan>& sends, int64_t receive_bytes,
                            const Consume& consume);
  // Every member's `send` to every member: recvs[i] receives member i's bytes. A recv of this
  // member that is `send` itself is left as it is.
  void gather(const CollectiveSite& site, ByteSpan send, const std::vector<ByteSpan>& recvs);
  void barrier(const CollectiveSite& site);

  // Bytes of one member's slot; a message larger than its share takes several rounds.
  static int64_t slot_bytes();
  // At most this many bytes go from one member to another in one round of an exchange (a
  // multiple of 64). The chunks that members 0..n-1 sent to this one in a round lie 2 * slot_bytes()
  // apart, so a reduction can view them as one strided tensor.
  int64_t receive_share() const;

  struct Layout;

 private:
  ShmChannel(GroupImpl& group, std::shared_ptr<SharedSegment> segment);

  // Runs one round: fills this member's slot, meets the others, drains theirs.
  void exchange_rounds(const CollectiveSite& site, const std::vector<ByteSpan>& sends,
                       const std::vector<int64_t>& expected, bool own_through_slot, const Consume& consume);
  template <typename Fill, typename Drain>
  void round(const CollectiveSite& site, Fill fill, Drain drain);
  void meet(const CollectiveSite& site);
  enum class Failure {
    kBadCall,  // the members' sizes disagree
    kMember,   // a member failed, left or exited
    kTimeout,  // a member did not arrive within the group's timeout
  };
  // The first round of every operation: this member says which collective it runs, and checks
  // that every member runs the same one (else fails, kBadCall).
  void post_call(const CollectiveSite& site, int parity);
  void check_calls(const CollectiveSite& site, int parity);
  // Marks the channel failed for every member, blaming group rank `culprit`, and throws.
  [[noreturn]] void fail(const CollectiveSite& site, const std::string& why, Failure kind, int culprit);
  // Empty, or why waiting for `round` is hopeless, the group rank to blame and the kind of failure.
  std::string check_members(uint64_t round, int* culprit, Failure* kind) const;
  // Why the group failed, as its first failure was recorded, for a member that did not see it happen.
  struct FailureRecord;
  std::string describe_failure(const FailureRecord& record) const;
  // Empty, or that group rank r left the group or its process exited.
  std::string member_gone(int r) const;
  std::string member_left(int r) const;
  void check_usable(const CollectiveSite& site);

  GroupImpl& group_;
  std::shared_ptr<SharedSegment> segment_;
  std::unique_ptr<Layout> layout_;
  uint64_t rounds_ = 0;  // rounds run so far: equal on every member
  bool broken_ = false;
};

}  // namespace hp::comm::detail
