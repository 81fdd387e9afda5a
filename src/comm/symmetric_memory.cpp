// Layout of the one segment that holds every member's buffer:
//   [member states: pid, left][signal words: member x channel x sender][buffers: one per member]
// A member's buffer starts on a page of its own. Signal words count the signals a sender sent to a
// member on a channel; the member keeps how many it has consumed, so the words are never reset and
// a signal is never lost between a reset and the next send.
#include "hp/comm/symmetric_memory.h"

#include <unistd.h>

#include <ATen/ATen.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "comm/group_impl.h"
#include "comm/shared_segment.h"
#include "comm/shared_wait.h"
#include "hp/core/error.h"

namespace hp::comm {
namespace detail {
namespace {

constexpr int64_t kLine = 64;
constexpr int64_t kPage = 4096;

int64_t round_up(int64_t bytes, int64_t to) { return (bytes + to - 1) / to * to; }

struct alignas(kLine) MemberRecord {
  std::atomic<int64_t> pid;    // 0 until the member has mapped the segment
  std::atomic<uint32_t> left;  // the member's SymmetricMemory is gone
};

// barrier() signals on a channel of its own, after the user's.
int with_barrier(int channels) { return channels + 1; }

}  // namespace

struct SymmetricState {
  ProcessGroup handle;  // keeps the group alive
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

  static int64_t signals_offset(int n) { return round_up(n * static_cast<int64_t>(sizeof(MemberRecord)), kLine); }
  static int64_t buffers_offset(int n, int channels) {
    return round_up(signals_offset(n) + int64_t{n} * with_barrier(channels) * n * 4, kPage);
  }
  static int64_t stride_of(int64_t bytes) { return round_up(std::max<int64_t>(bytes, 1), kPage); }

  // The word member `to` counts `from`'s signals on `channel` in.
  std::atomic<uint32_t>* signal_word(int to, int channel, int from) const {
    return signals + (int64_t{to} * with_barrier(channels) + channel) * n + from;
  }
  std::byte* buffer_of(int member) const { return buffers + member * stride; }
  int me() const { return group->rank; }
  std::string world_rank(int member) const { return "world rank " + std::to_string(group->ranks[member]); }
  std::string where(const char* op) const {
    return std::string("SymmetricMemory::") + op + " on " + group->describe() + ", " + world_rank(me());
  }

  void check_member(const char* op, int member, const char* role) const {
    HP_CHECK(member >= 0 && member < n, where(op), ": ", role, " ", member, " is not a member (the group has ", n, ")");
  }
  void check_channel(const char* op, int channel) const {
    HP_CHECK(channel >= 0 && channel < channels, where(op), ": channel ", channel, " is not one of the ", channels,
             " allocated");
  }
  void check_range(const char* op, int64_t offset, int64_t length) const {
    HP_CHECK(offset >= 0 && length >= 0 && offset + length <= bytes, where(op), ": bytes [", offset, ", ",
             offset + length, ") are outside the buffer of ", bytes, " bytes");
  }

  // Empty, or why member `from` can never signal again.
  std::string gone(int from) const {
    if (members[from].left.load(std::memory_order_acquire))
      return world_rank(from) + " left (its SymmetricMemory was destroyed)";
    const int64_t pid = members[from].pid.load(std::memory_order_acquire);
    if (pid > 0 && pid != getpid() && process_gone(pid)) return "the process of " + world_rank(from) + " exited";
    return "";
  }

  void signal(int to, int channel) const {
    std::atomic<uint32_t>* word = signal_word(to, channel, me());
    word->fetch_add(1, std::memory_order_release);
    wake_all(word);
  }

  void wait(const char* op, int from, int channel, std::chrono::milliseconds timeout) const {
    std::atomic<uint32_t>* word = signal_word(me(), channel, from);
    const uint32_t want = taken[static_cast<size_t>(channel) * n + from] + 1;
    // Counted with wrap-around: `want` has arrived once the word is at or past it.
    const auto arrived = [&] { return static_cast<int32_t>(word->load(std::memory_order_acquire) - want) >= 0; };
    const auto done = [&] { taken[static_cast<size_t>(channel) * n + from] = want; };
    for (int i = 0; i < 256; ++i) {
      if (arrived()) return done();
      cpu_relax();
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    constexpr std::chrono::milliseconds kSlice{20};  // between two looks at `from`
    for (;;) {
      const uint32_t seen = word->load(std::memory_order_acquire);
      if (arrived()) return done();
      futex_wait(word, seen, kSlice);
      if (arrived()) return done();
      if (const std::string why = gone(from); !why.empty()) {
        group->note_failure();
        throw hp::Error(where(op) + ": waiting for a signal from " + world_rank(from) + " on channel " +
                        std::to_string(channel) + ", but " + why);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        group->note_failure();
        throw hp::TimeoutError(where(op) + ": " + world_rank(from) + " did not signal channel " +
                               std::to_string(channel) + " within " + std::to_string(timeout.count()) + " ms");
      }
    }
  }

  ~SymmetricState() {
    if (members == nullptr) return;  // never mapped
    members[me()].left.store(1, std::memory_order_release);
    for (int to = 0; to < n; ++to)  // members waiting for this one look again
      for (int c = 0; c < with_barrier(channels); ++c) wake_all(signal_word(to, c, me()));
  }
};

namespace {

// Every member's (bytes, channels), through the store: all members see the same list, so they
// all agree or all fail.
void check_members_agree(GroupImpl& g, const std::string& keys, int64_t bytes, int channels) {
  const std::string mine = std::to_string(bytes) + " bytes, " + std::to_string(channels) + " channels";
  g.store->set(keys + "asks/" + std::to_string(g.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  bool agree = true;
  std::string asks;
  for (int r = 0; r < g.size(); ++r) {
    const std::string key = keys + "asks/" + std::to_string(r);
    g.store->wait({key}, g.options.timeout);
    const std::vector<uint8_t> value = g.store->get(key);
    const std::string theirs(value.begin(), value.end());
    agree = agree && theirs == mine;
    asks += (r == 0 ? "" : "; ") + std::string("world rank ") + std::to_string(g.ranks[r]) + ": " + theirs;
  }
  HP_CHECK(agree, "SymmetricMemory::allocate on ", g.describe(),
           ": every member must ask for the same bytes and channels; they asked for ", asks);
}

}  // namespace
}  // namespace detail

SymmetricMemory SymmetricMemory::allocate(const ProcessGroup& group, int64_t bytes, int channels) {
  HP_CHECK(group.defined(), "SymmetricMemory::allocate: the group is not defined");
  detail::GroupImpl* g = &group.impl();
  const std::string where = "SymmetricMemory::allocate on " + g->describe();
  HP_CHECK(!g->fake, where, ": a fake world's groups have no memory to share");
  HP_CHECK(bytes >= 0, where, ": bytes must be >= 0, got ", bytes);
  HP_CHECK(channels >= 1, where, ": channels must be >= 1, got ", channels);
  std::shared_ptr<detail::GroupRegistry> registry = g->registry.lock();
  HP_CHECK(registry, where, ": the group's world is gone");
  const std::optional<detail::SegmentScope> scope = detail::shared_scope(*registry, g->ranks);
  HP_CHECK(scope, where, ": its members are not all on this host; symmetric memory needs members that share memory");
  const std::string keys = "hp_symm/" + std::to_string(g->symmetric_allocations++) + "/";
  detail::check_members_agree(*g, keys, bytes, channels);

  auto state = std::make_shared<detail::SymmetricState>();
  state->handle = group;
  state->group = g;
  state->n = g->size();
  state->channels = channels;
  state->bytes = bytes;
  state->stride = detail::SymmetricState::stride_of(bytes);
  const int64_t total =
      detail::SymmetricState::buffers_offset(state->n, channels) + int64_t{state->n} * state->stride;
  detail::SharedSegment::Outcome outcome = detail::SharedSegment::create(*g, total, *scope, keys);
  HP_CHECK(outcome.segment, where, ": could not map ", total, " bytes on every member (", outcome.error, ")");
  state->segment = std::move(outcome.segment);
  std::byte* base = state->segment->data();
  state->members = reinterpret_cast<detail::MemberRecord*>(base);
  state->signals =
      reinterpret_cast<std::atomic<uint32_t>*>(base + detail::SymmetricState::signals_offset(state->n));
  state->buffers = base + detail::SymmetricState::buffers_offset(state->n, channels);
  state->taken.assign(static_cast<size_t>(detail::with_barrier(channels)) * state->n, 0);
  state->members[state->me()].pid.store(getpid(), std::memory_order_release);
  return SymmetricMemory(std::move(state));
}

int SymmetricMemory::rank() const { return state_->me(); }
int SymmetricMemory::size() const { return state_->n; }
int64_t SymmetricMemory::bytes() const { return state_->bytes; }
int SymmetricMemory::channels() const { return state_->channels; }

at::Tensor SymmetricMemory::buffer(int member, at::ScalarType dtype, at::IntArrayRef shape, int64_t offset) const {
  state_->check_member("buffer", member, "member");
  int64_t numel = 1;
  for (int64_t d : shape) {
    HP_CHECK(d >= 0, state_->where("buffer"), ": negative size in shape ", shape);
    numel *= d;
  }
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  state_->check_range("buffer", offset, numel * element);
  HP_CHECK(offset % element == 0, state_->where("buffer"), ": offset ", offset, " is not a multiple of ",
           c10::toString(dtype), "'s ", element, " bytes");
  std::shared_ptr<detail::SharedSegment> keep = state_->segment;
  return at::from_blob(
      state_->buffer_of(member) + offset, shape, [keep](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(dtype));
}

void SymmetricMemory::put(const at::Tensor& source, int peer, int64_t offset) const {
  state_->check_member("put", peer, "peer");
  HP_CHECK(source.device().is_cpu(), state_->where("put"), ": the source must be a CPU tensor, got one on ",
           source.device());
  buffer(peer, source.scalar_type(), source.sizes(), offset).copy_(source);
}

void SymmetricMemory::get(const at::Tensor& target, int peer, int64_t offset) const {
  state_->check_member("get", peer, "peer");
  HP_CHECK(target.device().is_cpu(), state_->where("get"), ": the target must be a CPU tensor, got one on ",
           target.device());
  target.copy_(buffer(peer, target.scalar_type(), target.sizes(), offset));
}

void SymmetricMemory::put_signal(int peer, int channel) const {
  state_->check_member("put_signal", peer, "peer");
  state_->check_channel("put_signal", channel);
  state_->signal(peer, channel);
}

void SymmetricMemory::wait_signal(int from, int channel, std::optional<std::chrono::milliseconds> timeout) const {
  state_->check_member("wait_signal", from, "sender");
  state_->check_channel("wait_signal", channel);
  state_->wait("wait_signal", from, channel, timeout.value_or(state_->group->options.timeout));
}

void SymmetricMemory::barrier() const {
  const int barrier_channel = state_->channels;
  for (int r = 0; r < state_->n; ++r)
    if (r != state_->me()) state_->signal(r, barrier_channel);
  for (int r = 0; r < state_->n; ++r)
    if (r != state_->me()) state_->wait("barrier", r, barrier_channel, state_->group->options.timeout);
}

}  // namespace hp::comm
