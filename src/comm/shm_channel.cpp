#include "comm/shm_channel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "comm/group_impl.h"
#include "comm/shared_wait.h"
#include "hp/core/error.h"

namespace hp::comm::detail {
namespace {

// The control block, at the start of the segment. Zeroed memory is its initial state.
struct Control {
  alignas(kCacheLine) std::atomic<uint64_t> arrivals;   // members' arrivals at rounds, summed over all rounds
  alignas(kCacheLine) std::atomic<uint32_t> completed;  // the last completed round (mod 2^32): the futex word
  alignas(kCacheLine) std::atomic<uint64_t> failed;     // 0: none; else a FailureRecord's bits, set once
};

struct alignas(kCacheLine) MemberState {
  std::atomic<uint64_t> arrived;  // the last round this member arrived at
  std::atomic<int64_t> pid;       // 0 until the member has opened the channel
  std::atomic<uint32_t> left;     // the member's group is gone
};

// Which operation a member runs: written with the first round of each operation, so that members
// running different collectives (a program that diverged) fail instead of mixing their bytes.
struct CallRecord {
  uint64_t seq;
  char op[24];  // the collective's name, cut to fit
};

// The bytes of `total` that round k moves when a round moves at most `share`.
int64_t chunk_of(int64_t total, int64_t k, int64_t share) { return std::clamp(total - k * share, int64_t{0}, share); }

void copy_bytes(std::byte* to, const std::byte* from, int64_t bytes) {
  if (bytes > 0) std::memcpy(to, from, static_cast<size_t>(bytes));
}

}  // namespace

// The first failure of the group, in one word so that its parts always belong together: the
// culprit, how it failed, and at which collective (its seq, mod 2^32: compared with the seq a
// member runs now, which is at most a few collectives away).
struct ShmChannel::FailureRecord {
  // The first member to fail timed out waiting for the culprit. Its peers, woken by it, time out
  // too (they would a moment later), so a missing member is a timeout on every member.
  static constexpr uint64_t kTimedOut = uint64_t{1} << 31;
  static constexpr uint64_t kBadCall = uint64_t{1} << 30;  // the culprit's call did not match (sizes, collective)
  static constexpr uint64_t kCulprit = kBadCall - 1;

  static uint64_t bits(int culprit, uint64_t kind, uint64_t seq) {
    return static_cast<uint64_t>(culprit + 1) | kind | ((seq + 1) & 0xffffffffu) << 32;
  }
  explicit FailureRecord(uint64_t bits)
      : culprit(static_cast<int>((bits & kCulprit)) - 1),
        timed_out((bits & kTimedOut) != 0),
        bad_call((bits & kBadCall) != 0),
        seq_plus_one(bits >> 32) {}
  bool at(uint64_t seq) const { return seq_plus_one == ((seq + 1) & 0xffffffffu); }
  int culprit;
  bool timed_out, bad_call;
  uint64_t seq_plus_one;
};

struct ShmChannel::Layout {
  Layout(std::byte* base, int members, int64_t slot) : n(members), slot(slot) {
    control = reinterpret_cast<Control*>(base);
    this->members = reinterpret_cast<MemberState*>(base + round_up(sizeof(Control), kCacheLine));
    lengths = reinterpret_cast<int64_t*>(reinterpret_cast<std::byte*>(this->members) + n * sizeof(MemberState));
    calls = reinterpret_cast<CallRecord*>(lengths + 2 * n * n);
    slots = base + slots_offset(members);
  }
  static int64_t slots_offset(int n) {
    return round_up(round_up(sizeof(Control), kCacheLine) + n * sizeof(MemberState) + 2 * n * n * sizeof(int64_t) +
                        2 * n * sizeof(CallRecord),
                    4096);
  }
  static int64_t bytes(int n, int64_t slot) { return slots_offset(n) + int64_t{2} * n * slot; }

  std::byte* slot_of(int member, int parity) const { return slots + (int64_t{member} * 2 + parity) * slot; }
  // What member `from` sends to each member in the first round of an operation of this parity.
  int64_t* lengths_of(int parity, int from) const { return lengths + (int64_t{parity} * n + from) * n; }
  // The operation member `from` runs, written with its first round of this parity.
  CallRecord* call_of(int parity, int from) const { return calls + int64_t{parity} * n + from; }

  int n;
  int64_t slot;
  Control* control;
  MemberState* members;
  int64_t* lengths;
  CallRecord* calls;
  std::byte* slots;
};

int64_t ShmChannel::slot_bytes() { return int64_t{4} << 20; }

std::shared_ptr<ShmChannel> ShmChannel::open(GroupImpl& group, SegmentScope scope, std::string* error) {
  SharedSegment::Outcome outcome = SharedSegment::create(group, Layout::bytes(group.size(), slot_bytes()), scope);
  if (!outcome.segment) {
    *error = outcome.error;
    return nullptr;
  }
  return std::shared_ptr<ShmChannel>(new ShmChannel(group, std::move(outcome.segment)));
}

ShmChannel::ShmChannel(GroupImpl& group, std::shared_ptr<SharedSegment> segment)
    : group_(group),
      segment_(std::move(segment)),
      layout_(std::make_unique<Layout>(segment_->data(), group.size(), slot_bytes())) {
  layout_->members[group_.rank].pid.store(getpid(), std::memory_order_release);
}

ShmChannel::~ShmChannel() { leave(); }

void ShmChannel::leave() {
  layout_->members[group_.rank].left.store(1, std::memory_order_release);
  wake_all(&layout_->control->completed);  // members waiting for this one look again
}

void ShmChannel::check_usable(const CollectiveSite& site) {
  if (layout_->members[group_.rank].left.load(std::memory_order_acquire)) {
    group_.note_failure();
    throw hp::Error(std::string(site.op) + " on " + group_.describe() + ", rank " +
                    std::to_string(group_.ranks[group_.rank]) + ": this rank has left the group (it gave up on it)");
  }
  const uint64_t failed = layout_->control->failed.load(std::memory_order_acquire);
  if (!broken_ && failed != 0) {
    const FailureRecord record(failed);
    const std::string why = describe_failure(record);
    if (record.at(site.seq)) {
      // Another member failed the group at this very collective while this one was on its way:
      // this one fails it too, naming the same culprit, and counts as arrived (here and in the
      // report of the ranks that reached it), so that nobody names it among the missing. Not as a
      // timeout even if the other member timed out: this one did not wait.
      layout_->members[group_.rank].arrived.store(rounds_ + 1, std::memory_order_release);
      fail(site, why, Failure::kMember, record.culprit);
    }
    broken_ = true;
    group_.note_failure();
    throw hp::Error(std::string(site.op) + " on " + group_.describe() + ", rank " +
                    std::to_string(group_.ranks[group_.rank]) + ", collective #" + std::to_string(site.seq) +
                    ": an earlier collective on this group failed (" + why +
                    "), and its shared memory may hold a half-finished exchange; the group cannot be used any more");
  }
  if (broken_) {
    group_.note_failure();
    throw hp::Error(std::string(site.op) + " on " + group_.describe() + ", rank " +
                    std::to_string(group_.ranks[group_.rank]) +
                    ": an earlier collective on this group failed, and its shared memory may hold a half-finished "
                    "exchange; the group cannot be used any more");
  }
}

// Worded without "timeout": raise_collective_failure reads that word as this member's own timeout.
std::string ShmChannel::describe_failure(const FailureRecord& record) const {
  const int culprit = record.culprit;
  if (record.bad_call)
    return "another member found that world rank " + std::to_string(group_.ranks[culprit]) +
           (culprit == group_.rank ? " (this one)" : "") + " called a collective its own does not match";
  const std::string waited = record.timed_out ? " for the group's whole wait" : "";
  if (culprit == group_.rank)
    return "another member gave up waiting for this rank" + waited + ": it was held up elsewhere";
  if (std::string gone = member_gone(culprit); !gone.empty()) return gone;
  return "another member gave up on this group because of world rank " + std::to_string(group_.ranks[culprit]) + waited;
}

std::string ShmChannel::member_left(int r) const {
  return "world rank " + std::to_string(group_.ranks[r]) +
         " left the group (it gave up on it after an error, or its process group was destroyed)";
}

std::string ShmChannel::member_gone(int r) const {
  const MemberState& member = layout_->members[r];
  if (member.left.load(std::memory_order_acquire)) return member_left(r);
  const int64_t pid = member.pid.load(std::memory_order_acquire);
  if (pid > 0 && pid != getpid() && process_gone(pid))
    return "world rank " + std::to_string(group_.ranks[r]) + " (process " + std::to_string(pid) + ") has exited";
  return "";
}

void ShmChannel::post_call(const CollectiveSite& site, int parity) {
  CallRecord* mine = layout_->call_of(parity, group_.rank);
  mine->seq = site.seq;
  std::strncpy(mine->op, site.op, sizeof(mine->op) - 1);
  mine->op[sizeof(mine->op) - 1] = '\0';
}

void ShmChannel::check_calls(const CollectiveSite& site, int parity) {
  const CallRecord* mine = layout_->call_of(parity, group_.rank);
  for (int i = 0; i < layout_->n; ++i) {
    const CallRecord* theirs = layout_->call_of(parity, i);
    if (theirs->seq == mine->seq && std::strncmp(theirs->op, mine->op, sizeof(mine->op)) == 0) continue;
    const std::string their_op(theirs->op, strnlen(theirs->op, sizeof(theirs->op)));  // never past the record
    fail(site,
         "world rank " + std::to_string(group_.ranks[i]) + " runs " + their_op + " (collective #" +
             std::to_string(theirs->seq) + ") while this rank runs " + mine->op + " (collective #" +
             std::to_string(mine->seq) + "): the members' programs issue different collectives on this group",
         Failure::kBadCall, i);
  }
}

std::string ShmChannel::check_members(uint64_t round, int* culprit, Failure* kind) const {
  *kind = Failure::kMember;
  // A failure recorded first is the cause: a member that left since (its rank gave up on the
  // failed group) is its consequence.
  if (const uint64_t failed = layout_->control->failed.load(std::memory_order_acquire); failed != 0) {
    const FailureRecord record(failed);
    *culprit = record.culprit;
    if (record.timed_out) *kind = Failure::kTimeout;
    return describe_failure(record);
  }
  for (int r = 0; r < layout_->n; ++r) {
    const MemberState& member = layout_->members[r];
    if (r == group_.rank) continue;
    // `left` before `arrived`: it is set after, so a member that arrived and then left counts as arrived.
    const bool left = member.left.load(std::memory_order_acquire);
    if (member.arrived.load(std::memory_order_acquire) >= round) continue;
    if (std::string gone = left ? member_left(r) : member_gone(r); !gone.empty()) {
      *culprit = r;
      return gone;
    }
  }
  return "";
}

void ShmChannel::fail(const CollectiveSite& site, const std::string& why, Failure kind, int culprit) {
  broken_ = true;
  // Tell the others, who may be waiting for this member in a later round, and who is to blame (the
  // first failure wins).
  uint64_t none = 0;
  const uint64_t how = kind == Failure::kTimeout   ? FailureRecord::kTimedOut
                       : kind == Failure::kBadCall ? FailureRecord::kBadCall
                                                   : 0;
  layout_->control->failed.compare_exchange_strong(none, FailureRecord::bits(culprit, how, site.seq));
  wake_all(&layout_->control->completed);
  if (kind == Failure::kBadCall) {
    // Every member arrived: there is nobody missing to look for.
    group_.note_failure();
    throw hp::Error(std::string(site.op) + " on " + group_.describe() + ", rank " +
                    std::to_string(group_.ranks[group_.rank]) + ", collective #" + std::to_string(site.seq) + ": " +
                    why);
  }
  const std::string cause = "shared-memory transport: " + why;
  // A culprit whose process exited, or that left, will not report reaching this collective.
  const bool gone = kind == Failure::kMember && culprit >= 0 && culprit != group_.rank && !member_gone(culprit).empty();
  raise_collective_failure(
      site, std::make_exception_ptr(std::runtime_error(kind == Failure::kTimeout ? cause + " (timed out)" : cause)),
      gone ? std::vector<int>{culprit} : std::vector<int>{});
}

void ShmChannel::meet(const CollectiveSite& site) {
  const uint64_t round = ++rounds_;
  Control& control = *layout_->control;
  layout_->members[group_.rank].arrived.store(round, std::memory_order_release);
  const auto target = static_cast<uint32_t>(round);
  if (control.arrivals.fetch_add(1, std::memory_order_acq_rel) + 1 == round * layout_->n) {
    control.completed.store(target, std::memory_order_release);
    wake_all(&control.completed);
    return;
  }
  int culprit = -1;
  Failure kind = Failure::kMember;
  std::string why;
  const WaitOutcome outcome = wait_until(
      &control.completed, [&] { return control.completed.load(std::memory_order_acquire) == target; },
      [&] {
        why = check_members(round, &culprit, &kind);
        return !why.empty();
      },
      deadline_after(group_.options.timeout), std::chrono::milliseconds(50));
  if (outcome == WaitOutcome::kArrived) return;
  if (outcome == WaitOutcome::kHopeless) fail(site, why, kind, culprit);
  std::string missing;
  culprit = group_.rank;
  for (int r = 0; r < layout_->n; ++r) {
    if (layout_->members[r].arrived.load(std::memory_order_acquire) >= round) continue;
    missing += (missing.empty() ? "" : ", ") + std::to_string(group_.ranks[r]);
    culprit = r;
  }
  fail(site, "world ranks [" + missing + "] did not arrive", Failure::kTimeout, culprit);
}

template <typename Fill, typename Drain>
void ShmChannel::round(const CollectiveSite& site, Fill fill, Drain drain) {
  const int parity = static_cast<int>(rounds_ % 2);
  fill(parity);
  meet(site);
  drain(parity);
}

void ShmChannel::exchange(const CollectiveSite& site, const std::vector<ByteSpan>& sends,
                          const std::vector<ByteSpan>& recvs) {
  const int me = group_.rank;
  HP_CHECK(static_cast<int>(recvs.size()) == layout_->n && static_cast<int>(sends.size()) == layout_->n &&
               sends[me].size == recvs[me].size,
           "ShmChannel::exchange: malformed call");
  copy_bytes(recvs[me].data, sends[me].data, sends[me].size);
  std::vector<int64_t> expected;
  for (const ByteSpan& r : recvs) expected.push_back(r.size);
  exchange_rounds(site, sends, expected, /*own_through_slot=*/false,
                  [&](const std::vector<ByteSpan>& received, int64_t offset) {
                    for (int i = 0; i < layout_->n; ++i)
                      if (i != me) copy_bytes(recvs[i].data + offset, received[i].data, received[i].size);
                  });
}

void ShmChannel::exchange_and_consume(const CollectiveSite& site, const std::vector<ByteSpan>& sends,
                                      int64_t receive_bytes, const Consume& consume) {
  HP_CHECK(static_cast<int>(sends.size()) == layout_->n && sends[group_.rank].size == receive_bytes,
           "ShmChannel::exchange_and_consume: malformed call");
  exchange_rounds(site, sends, std::vector<int64_t>(layout_->n, receive_bytes), /*own_through_slot=*/true, consume);
}

int64_t ShmChannel::receive_share() const { return layout_->slot / layout_->n / kCacheLine * kCacheLine; }

void ShmChannel::exchange_rounds(const CollectiveSite& site, const std::vector<ByteSpan>& sends,
                                 const std::vector<int64_t>& expected, bool own_through_slot, const Consume& consume) {
  check_usable(site);
  const int n = layout_->n;
  const int me = group_.rank;
  const int64_t share = receive_share();  // of a slot, per receiver
  int64_t rounds = 1;
  std::vector<ByteSpan> received(n);
  for (int64_t k = 0; k < rounds; ++k) {
    round(
        site,
        [&](int parity) {
          if (k == 0) {
            post_call(site, parity);
            for (int j = 0; j < n; ++j) layout_->lengths_of(parity, me)[j] = sends[j].size;
          }
          std::byte* slot = layout_->slot_of(me, parity);
          for (int j = 0; j < n; ++j)
            if (j != me || own_through_slot)
              copy_bytes(slot + j * share, sends[j].data + k * share, chunk_of(sends[j].size, k, share));
        },
        [&](int parity) {
          if (k == 0) {
            check_calls(site, parity);
            for (int i = 0; i < n; ++i) {
              for (int j = 0; j < n; ++j)
                rounds = std::max(rounds, (layout_->lengths_of(parity, i)[j] + share - 1) / share);
              const int64_t sent = layout_->lengths_of(parity, i)[me];
              if (i != me && sent != expected[i])
                fail(site,
                     "world rank " + std::to_string(group_.ranks[i]) + " sends " + std::to_string(sent) +
                         " bytes to this rank, which expects " + std::to_string(expected[i]),
                     Failure::kBadCall, i);
            }
          }
          for (int i = 0; i < n; ++i)
            received[i] = {layout_->slot_of(i, parity) + me * share, chunk_of(expected[i], k, share)};
          consume(received, k * share);
        });
  }
}

void ShmChannel::gather(const CollectiveSite& site, ByteSpan send, const std::vector<ByteSpan>& recvs) {
  check_usable(site);
  const int n = layout_->n;
  const int me = group_.rank;
  HP_CHECK(static_cast<int>(recvs.size()) == n && recvs[me].size == send.size, "ShmChannel::gather: malformed call");
  if (recvs[me].data != send.data) copy_bytes(recvs[me].data, send.data, send.size);
  const int64_t share = layout_->slot;
  int64_t rounds = 1;
  for (int64_t k = 0; k < rounds; ++k) {
    round(
        site,
        [&](int parity) {
          if (k == 0) {
            post_call(site, parity);
            layout_->lengths_of(parity, me)[0] = send.size;
          }
          copy_bytes(layout_->slot_of(me, parity), send.data + k * share, chunk_of(send.size, k, share));
        },
        [&](int parity) {
          if (k == 0) {
            check_calls(site, parity);
            for (int i = 0; i < n; ++i) {
              const int64_t sent = layout_->lengths_of(parity, i)[0];
              rounds = std::max(rounds, (sent + share - 1) / share);
              if (i != me && sent != recvs[i].size)
                fail(site,
                     "world rank " + std::to_string(group_.ranks[i]) + " sends " + std::to_string(sent) +
                         " bytes, and this rank expects " + std::to_string(recvs[i].size),
                     Failure::kBadCall, i);
            }
          }
          for (int i = 0; i < n; ++i)
            if (i != me)
              copy_bytes(recvs[i].data + k * share, layout_->slot_of(i, parity), chunk_of(recvs[i].size, k, share));
        });
  }
}

void ShmChannel::barrier(const CollectiveSite& site) {
  check_usable(site);
  round(
      site, [&](int parity) { post_call(site, parity); }, [&](int parity) { check_calls(site, parity); });
}

}  // namespace hp::comm::detail
