// Layout of the one segment that holds every member's buffer:
//   [member records: pid, left][signal words: member x channel x sender][buffers: one per member]
// A member's buffer starts on a page of its own. Signal words count the signals a sender sent to a
// member on a channel; the member keeps how many it has consumed, so the words are never reset and
// a signal is never lost between a reset and the next send.
#include "hp/comm/symmetric_memory.h"

#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>
#include <vector>

#include "comm/group_impl.h"
#include "comm/shared_segment.h"
#include "comm/shared_wait.h"
#include "comm/symmetric_access.h"
#include "hp/core/error.h"

namespace hp::comm {
namespace detail {
namespace {

constexpr int64_t kPage = 4096;
// Bounds that keep every size and offset below far from int64's end (and the signal words few).
constexpr int64_t kMaxBytes = int64_t{1} << 40;
constexpr int kMaxChannels = 1024;

struct alignas(kCacheLine) MemberRecord {
  std::atomic<int64_t> pid;    // 0 until the member has mapped the segment
  std::atomic<uint32_t> left;  // the member's SymmetricMemory is gone
};

// What this member may ask for, or why not; `scope` how its members share memory.
std::string check_request(const GroupImpl& g, int64_t bytes, int channels, SegmentScope* scope) {
  if (bytes < 0 || bytes > kMaxBytes) return "bytes must be in [0, 2^40], got " + std::to_string(bytes);
  if (channels < 1 || channels > kMaxChannels)
    return "channels must be in [1, " + std::to_string(kMaxChannels) + "], got " + std::to_string(channels);
  const std::shared_ptr<GroupRegistry> registry = g.registry.lock();
  if (!registry) return "the group's world is gone";
  const std::optional<SegmentScope> shared = shared_scope(*registry, g.ranks);
  if (!shared) return "its members are not all on this host; symmetric memory needs members that share memory";
  if (g.options.timeout.count() < 0) return "the group's timeout is negative";
  *scope = *shared;
  return "";
}

}  // namespace

struct SymmetricState {
  ProcessGroup handle;  // keeps the group alive (empty for the group's own memory, which it outlives)
  GroupImpl* group = nullptr;
  std::shared_ptr<SharedSegment> segment;
  int n = 0;
  int channels = 0;  // the user's; the segment has one more, barrier()'s
  int64_t bytes = 0;
  MemberRecord* members = nullptr;
  std::atomic<uint32_t>* signals = nullptr;
  std::byte* buffers = nullptr;
  int64_t stride = 0;                   // between two members' buffers
  mutable std::vector<uint32_t> taken;  // signals consumed, per (channel, sender)
  mutable std::string failure;          // the first failed wait: no later operation may run

  static int64_t signals_offset(int n) { return round_up(n * static_cast<int64_t>(sizeof(MemberRecord)), kCacheLine); }
  static int64_t buffers_offset(int n, int channels) {
    return round_up(signals_offset(n) + int64_t{n} * (channels + 1) * n * 4, kPage);
  }
  static int64_t stride_of(int64_t bytes) { return round_up(std::max<int64_t>(bytes, 1), kPage); }

  // The word member `to` counts `from`'s signals on `channel` in.
  std::atomic<uint32_t>* signal_word(int to, int channel, int from) const {
    return signals + (int64_t{to} * (channels + 1) + channel) * n + from;
  }
  std::byte* buffer_of(int member) const { return buffers + member * stride; }
  int me() const { return group->rank; }
  std::string world_rank(int member) const { return "world rank " + std::to_string(group->ranks[member]); }
  std::string where(const char* op) const {
    return std::string("SymmetricMemory::") + op + " on " + group->describe() + ", " + world_rank(me());
  }

  void check_usable(const char* op) const {
    HP_CHECK(failure.empty(), where(op), ": an earlier wait on this SymmetricMemory failed (", failure,
             "); a signal that comes late would satisfy the wrong wait, so it cannot be used any more");
  }
  void check_member(const char* op, int member, const char* role) const {
    HP_CHECK(member >= 0 && member < n, where(op), ": ", role, " ", member, " is not a member (the group has ", n, ")");
  }
  void check_channel(const char* op, int channel) const {
    HP_CHECK(channel >= 0 && channel < channels, where(op), ": channel ", channel, " is not one of the ", channels,
             " allocated");
  }
  // Written so that nothing overflows: length and offset are each at most `bytes` first.
  void check_range(const char* op, int64_t offset, int64_t length) const {
    HP_CHECK(length >= 0 && offset >= 0 && length <= bytes && offset <= bytes - length, where(op), ": ", length,
             " bytes at offset ", offset, " are outside the buffer of ", bytes, " bytes");
  }

  // Empty, or why member `from` can never signal again.
  std::string gone(int from) const {
    if (members[from].left.load(std::memory_order_acquire))
      return world_rank(from) + " left (the last handle to its SymmetricMemory was destroyed)";
    const int64_t pid = members[from].pid.load(std::memory_order_acquire);
    if (pid > 0 && pid != getpid() && process_gone(pid)) return "the process of " + world_rank(from) + " exited";
    return "";
  }

  void signal(int to, int channel) const {
    std::atomic<uint32_t>* word = signal_word(to, channel, me());
    word->fetch_add(1, std::memory_order_release);
    wake_all(word);
  }

  void wait(const char* op, int from, int channel, std::chrono::steady_clock::time_point deadline,
            std::chrono::milliseconds timeout) const {
    std::atomic<uint32_t>* word = signal_word(me(), channel, from);
    uint32_t& consumed = taken[static_cast<size_t>(channel) * n + from];
    const uint32_t want = consumed + 1;
    // Counted with wrap-around: `want` has arrived once the word is at or past it.
    const auto arrived = [&] { return static_cast<int32_t>(word->load(std::memory_order_acquire) - want) >= 0; };
    std::string why;
    const WaitOutcome outcome = wait_until(
        word, arrived,
        [&] {
          why = gone(from);
          return !why.empty();
        },
        deadline, std::chrono::milliseconds(20));
    if (outcome == WaitOutcome::kArrived) {
      consumed = want;
      return;
    }
    const std::string what = op == std::string("barrier") ? "the barrier" : "channel " + std::to_string(channel);
    group->note_failure();
    if (outcome == WaitOutcome::kHopeless) {
      failure = "waiting for a signal from " + world_rank(from) + " on " + what + ", but " + why;
      throw hp::Error(where(op) + ": " + failure);
    }
    failure = world_rank(from) + " did not signal " + what + " within " + std::to_string(timeout.count()) + " ms";
    throw hp::TimeoutError(where(op) + ": " + failure);
  }

  ~SymmetricState() {
    if (members == nullptr) return;  // never mapped
    members[me()].left.store(1, std::memory_order_release);
    for (int to = 0; to < n; ++to)  // members waiting for this one look again
      for (int c = 0; c <= channels; ++c) wake_all(signal_word(to, c, me()));
  }
};

namespace {

// allocate() once this member's request is known: every member's request through the store, then
// the segment, mapped by all if they all asked alike.
std::shared_ptr<SymmetricState> map_agreed(const ProcessGroup& group, int64_t bytes, int channels, SegmentScope scope,
                                           const std::string& keys, const std::string& request,
                                           const std::string& objection, bool keep_group_alive, std::string* no_room) {
  GroupImpl* g = &group.impl();
  const std::string where = "SymmetricMemory::allocate on " + g->describe();
  const std::vector<std::string> requests =
      exchange_strings(*g, keys + "requests/", request, "SymmetricMemory::allocate");
  std::string listed;
  bool agree = true;
  for (int r = 0; r < g->size(); ++r) {
    agree = agree && requests[r] == request && objection.empty();
    listed += (r == 0 ? "" : "; ") + std::string("world rank ") + std::to_string(g->ranks[r]) + ": " + requests[r];
  }
  HP_CHECK(objection.empty(), where, ": ", objection, " (the members asked for ", listed, ")");
  HP_CHECK(agree, where, ": every member must ask for the same bytes and channels; they asked for ", listed);

  auto state = std::make_shared<SymmetricState>();
  if (keep_group_alive) state->handle = group;
  state->group = g;
  state->n = g->size();
  state->channels = channels;
  state->bytes = bytes;
  state->stride = SymmetricState::stride_of(bytes);
  const int64_t total = SymmetricState::buffers_offset(state->n, channels) + int64_t{state->n} * state->stride;
  SharedSegment::Outcome outcome = SharedSegment::create(*g, total, scope, keys);
  if (!outcome.segment) {
    const std::string why =
        ::hp::detail::str_cat("could not map ", total, " bytes on every member (", outcome.error, ")");
    if (outcome.no_room && no_room != nullptr) {
      *no_room = why;
      return nullptr;
    }
    HP_FAIL(where, ": ", why);
  }
  state->segment = std::move(outcome.segment);
  std::byte* base = state->segment->data();
  state->members = reinterpret_cast<MemberRecord*>(base);
  state->signals = reinterpret_cast<std::atomic<uint32_t>*>(base + SymmetricState::signals_offset(state->n));
  state->buffers = base + SymmetricState::buffers_offset(state->n, channels);
  state->taken.assign(static_cast<size_t>(channels + 1) * state->n, 0);
  state->members[state->me()].pid.store(getpid(), std::memory_order_release);
  return state;
}

}  // namespace
}  // namespace detail

namespace detail {

std::shared_ptr<SymmetricState> SymmetricAccess::allocate_state(const ProcessGroup& group, int64_t bytes, int channels,
                                                                bool keep_group_alive, std::string* no_room) {
  GroupImpl* g = &group.impl();
  HP_CHECK(!g->fake, "SymmetricMemory::allocate on ", g->describe(), ": a fake world's groups have no memory to share");
  // The allocation's number, taken before anything can fail, so that it stays equal on every
  // member; a member's own objection travels with its request, so every member fails alike.
  const std::string keys = "hp_symm/" + std::to_string(g->symmetric_allocations++) + "/";
  SegmentScope scope = SegmentScope::kProcess;
  const std::string objection = check_request(*g, bytes, channels, &scope);
  const std::string request = objection.empty()
                                  ? std::to_string(bytes) + " bytes, " + std::to_string(channels) + " channels"
                                  : "refused: " + objection;
  try {
    return map_agreed(group, bytes, channels, scope, keys, request, objection, keep_group_alive, no_room);
  } catch (...) {
    g->note_failure();  // this rank's failure on the group (the trainer's error accounting)
    throw;
  }
}

std::optional<SymmetricMemory> SymmetricAccess::allocate_held_by_group(const ProcessGroup& group, int64_t bytes,
                                                                       int channels, std::string& no_room) {
  std::shared_ptr<SymmetricState> state = allocate_state(group, bytes, channels, /*keep_group_alive=*/false, &no_room);
  if (!state) return std::nullopt;
  return SymmetricMemory(std::move(state));
}

}  // namespace detail

SymmetricMemory SymmetricMemory::allocate(const ProcessGroup& group, int64_t bytes, int channels) {
  return SymmetricMemory(detail::SymmetricAccess::allocate_state(group, bytes, channels, /*keep_group_alive=*/true));
}

const detail::SymmetricState& SymmetricMemory::state() const {
  HP_CHECK(state_, "SymmetricMemory: this handle is empty (it was moved from)");
  return *state_;
}

int SymmetricMemory::rank() const { return state().me(); }
int SymmetricMemory::size() const { return state().n; }
int64_t SymmetricMemory::bytes() const { return state().bytes; }
int SymmetricMemory::channels() const { return state().channels; }

at::Tensor SymmetricMemory::buffer(int member, at::ScalarType dtype, at::IntArrayRef shape, int64_t offset) const {
  const detail::SymmetricState& s = state();
  s.check_member("buffer", member, "member");
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  int64_t length = element;  // bytes
  bool overflows = false;
  for (int64_t d : shape) {
    HP_CHECK(d >= 0, s.where("buffer"), ": negative size in shape ", shape);
    overflows = overflows || __builtin_mul_overflow(length, d, &length);
  }
  HP_CHECK(!overflows, s.where("buffer"), ": shape ", shape, " of ", c10::toString(dtype),
           " is more bytes than int64 counts, far outside the buffer of ", s.bytes, " bytes");
  s.check_range("buffer", offset, length);
  HP_CHECK(offset % element == 0, s.where("buffer"), ": offset ", offset, " is not a multiple of ",
           c10::toString(dtype), "'s ", element, " bytes");
  std::shared_ptr<detail::SharedSegment> keep = s.segment;
  return at::from_blob(
      s.buffer_of(member) + offset, shape, [keep](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(dtype));
}

void SymmetricMemory::put(const at::Tensor& source, int peer, int64_t offset) const {
  const detail::SymmetricState& s = state();
  s.check_usable("put");
  s.check_member("put", peer, "peer");
  HP_CHECK(source.device().is_cpu(), s.where("put"), ": the source must be a CPU tensor, got one on ", source.device());
  buffer(peer, source.scalar_type(), source.sizes(), offset).copy_(source);
}

void SymmetricMemory::get(const at::Tensor& target, int peer, int64_t offset) const {
  const detail::SymmetricState& s = state();
  s.check_usable("get");
  s.check_member("get", peer, "peer");
  HP_CHECK(target.device().is_cpu(), s.where("get"), ": the target must be a CPU tensor, got one on ", target.device());
  target.copy_(buffer(peer, target.scalar_type(), target.sizes(), offset));
}

void SymmetricMemory::put_signal(int peer, int channel) const {
  const detail::SymmetricState& s = state();
  s.check_usable("put_signal");
  s.check_member("put_signal", peer, "peer");
  s.check_channel("put_signal", channel);
  s.signal(peer, channel);
}

void SymmetricMemory::wait_signal(int from, int channel, std::optional<std::chrono::milliseconds> timeout) const {
  const detail::SymmetricState& s = state();
  s.check_usable("wait_signal");
  s.check_member("wait_signal", from, "sender");
  s.check_channel("wait_signal", channel);
  HP_CHECK(!timeout || timeout->count() >= 0, s.where("wait_signal"), ": the timeout must be >= 0 ms, got ",
           timeout ? timeout->count() : 0);
  const std::chrono::milliseconds limit = timeout.value_or(s.group->options.timeout);
  s.wait("wait_signal", from, channel, detail::deadline_after(limit), limit);
}

void SymmetricMemory::barrier() const {
  const detail::SymmetricState& s = state();
  s.check_usable("barrier");
  const int barrier_channel = s.channels;
  for (int r = 0; r < s.n; ++r)
    if (r != s.me()) s.signal(r, barrier_channel);
  const std::chrono::milliseconds timeout = s.group->options.timeout;  // >= 0: allocate checked
  const auto deadline = detail::deadline_after(timeout);               // one for the whole barrier
  for (int r = 0; r < s.n; ++r)
    if (r != s.me()) s.wait("barrier", r, barrier_channel, deadline, timeout);
}

}  // namespace hp::comm
