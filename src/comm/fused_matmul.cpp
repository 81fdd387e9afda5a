// hp/comm/fused_matmul.h. On groups that share memory the ops meet in the group's symmetric memory.
// Each member's buffer holds [its header: the op, the operands' shapes, the bytes of data][data]:
//   all_gather_matmul:     the member's shard
//   matmul_reduce_scatter: n products, one per writer, in rank order (the pieces the member keeps)
// An op goes in two rounds on channel 0 ("it is there"): first every member's header, checked
// against its own before anything else moves (a member that passed other shapes fails every
// member, naming it; every member grows the workspace at the same op, as the headers agree on its
// size), then the data. Channel 1 says "I have read what I needed": before its next op writes
// anything, a member collects every peer's "done" of the last one (a barrier split in two halves,
// which costs nothing when the peers have finished). Where there is no room for the workspace (every
// member learns it alike), the op, and every later one on the group, runs unfused.
#include "hp/comm/fused_matmul.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "comm/group_impl.h"
#include "comm/symmetric_access.h"
#include "hp/comm/comm_debug_mode.h"
#include "hp/comm/symmetric_memory.h"
#include "hp/comm/tree_reduce.h"
#include "hp/core/error.h"
#include "hp/core/log.h"

namespace hp::comm {
namespace detail {

struct FusedWorkspace {
  std::optional<SymmetricMemory> memory;
  bool owes_done = false;       // the last op's "done" signals are still to be collected
  std::string broken;           // why an op stopped halfway: the members' signals no longer pair up
  bool warned_unfused = false;  // that the ops run unfused on this group
  // Why there was no room for the workspace (a full /dev/shm): the group's ops run unfused from
  // then on, on every member alike (the members agree on the mapping's outcome).
  std::string no_room;
  // On a fake world (a dry run), which maps nothing: the bytes a real group would map for the ops
  // run on it so far (fused_workspace_bytes).
  int64_t fake_bytes = 0;
};

namespace {

constexpr int kData = 0, kDone = 1;
// [count, the first 14 values, a hash of all]: what every member must pass alike.
constexpr int64_t kHeaderValues = 16;
constexpr int64_t kHeaderBytes = kHeaderValues * static_cast<int64_t>(sizeof(int64_t));
constexpr int64_t kMinWorkspaceBytes = int64_t{1} << 20;
constexpr int64_t kMaxDataBytes = int64_t{1} << 40;  // SymmetricMemory's bound
// The header of a member that refused its own operands (every value).
constexpr int64_t kRefused = -1;
enum FusedOp : int64_t { kAllGatherMatmul = 1, kMatmulReduceScatter = 2 };

// `data_bytes`: what the op puts in each member's buffer after the header.
at::Tensor header_of(FusedOp op, int64_t dim, const at::Tensor& a, const std::vector<at::Tensor>& bs,
                     int64_t data_bytes) {
  std::vector<int64_t> values = {op, dim, static_cast<int64_t>(a.scalar_type()), data_bytes, a.dim()};
  for (int64_t d : a.sizes()) values.push_back(d);
  for (const at::Tensor& b : bs) values.insert(values.end(), {b.size(0), b.size(1)});
  std::vector<int64_t> header(kHeaderValues, 0);
  header[0] = static_cast<int64_t>(values.size());
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the values
  for (size_t i = 0; i < values.size(); ++i) {
    if (i + 2 < kHeaderValues) header[i + 1] = values[i];
    hash = (hash ^ static_cast<uint64_t>(values[i])) * 1099511628211ull;
  }
  header.back() = static_cast<int64_t>(hash);
  return at::tensor(header, at::kLong);
}

at::Tensor peer_header(const SymmetricMemory& memory, int peer) {
  return memory.buffer(peer, at::kLong, {kHeaderValues});
}

bool refused(const at::Tensor& header) { return header.data_ptr<int64_t>()[0] == kRefused; }

// `peer`'s header against this member's.
void check_header(const SymmetricMemory& memory, int peer, const at::Tensor& mine, const char* op, const GroupImpl& g) {
  const at::Tensor theirs = peer_header(memory, peer);
  HP_CHECK(!refused(theirs), op, " on ", g.describe(), ": world rank ", g.ranks[peer],
           " refused its operands (its error says why)");
  HP_CHECK(at::equal(theirs, mine), op, " on ", g.describe(), ": world rank ", g.ranks[peer],
           " passed other operands than world rank ", g.ranks[g.rank],
           " ([values, op, dim, dtype, data bytes, a's rank and shape, each b's shape, hash]: ",
           at::IntArrayRef(theirs.data_ptr<int64_t>(), kHeaderValues), " against ",
           at::IntArrayRef(mine.data_ptr<int64_t>(), kHeaderValues),
           "); every member passes the same shapes and dtype");
}

FusedWorkspace& workspace_of(GroupImpl& g) {
  if (!g.fused_workspace) g.fused_workspace = std::make_shared<FusedWorkspace>();
  return *g.fused_workspace;
}

// Room for a header and `data_bytes` (at most kMaxDataBytes) of data, rounded up to a power of two.
int64_t workspace_bytes(int64_t data_bytes) {
  int64_t data = kMinWorkspaceBytes;
  while (data < data_bytes) data *= 2;
  return kHeaderBytes + data;
}

// Signals every peer on `channel`, and waits for a signal from every peer on it.
void signal_peers(const SymmetricMemory& memory, int channel) {
  for (int peer = 0; peer < memory.size(); ++peer)
    if (peer != memory.rank()) memory.put_signal(peer, channel);
}
void wait_for_peers(const SymmetricMemory& memory, int channel) {
  for (int peer = 0; peer < memory.size(); ++peer)
    if (peer != memory.rank()) memory.wait_signal(peer, channel);
}

// Maps the group's workspace with room for `data_bytes`; where there is no room for it (on any
// member), the group's fused ops run unfused from now on (which each member says once) and this
// returns false on every member alike. Any other failure to map it throws.
bool map_workspace(const ProcessGroup& group, const char* op, int64_t data_bytes) {
  GroupImpl& g = group.impl();
  FusedWorkspace& ws = workspace_of(g);
  std::string no_room;
  ws.memory = SymmetricAccess::allocate_held_by_group(group, workspace_bytes(data_bytes), /*channels=*/2, no_room);
  if (ws.memory) return true;
  ws.no_room = no_room;
  ws.owes_done = false;
  log::warn(op, " on ", g.describe(), " runs as the unfused collective and matmul from now on: there is no room for ",
            "its workspace: ", no_room,
            g.shm_scope == SegmentScope::kHost
                ? ". Between processes it lives in /dev/shm (a container's is often 64 MiB: docker run --shm-size)"
                : "");
  return false;
}

// Shows this member's header to every peer and waits for theirs, once every peer has read what this
// member's last op left for it; returns the workspace (mapped by the group's first op), or nullptr
// where there is no room for it (map_workspace).
const SymmetricMemory* show_header(const ProcessGroup& group, const char* op, const at::Tensor& header) {
  GroupImpl& g = group.impl();
  FusedWorkspace& ws = workspace_of(g);
  if (!ws.memory) {
    if (!map_workspace(group, op, 0)) return nullptr;
  } else if (ws.owes_done) {
    wait_for_peers(*ws.memory, kDone);
  }
  ws.owes_done = false;
  const SymmetricMemory& shown = *ws.memory;
  shown.put(header, g.rank);
  signal_peers(shown, kData);
  wait_for_peers(shown, kData);
  return &shown;
}

void check_usable(const GroupImpl& g, const char* op) {
  const FusedWorkspace* ws = g.fused_workspace.get();
  HP_CHECK(ws == nullptr || ws->broken.empty(), op, " on ", g.describe(),
           ": an earlier fused op on this group failed (", ws->broken,
           "); its members no longer agree where they stand, so no fused op can run on it any more");
}

// The group's workspace, with room for `header`'s data, once every member has shown its header
// (equal to this member's) and every peer has read what this member's last op left for it; nullptr
// on every member alike where there is no room for it (then the op runs unfused).
// Allocating and growing are collective: the first op allocates, and the headers, equal on every
// member, say the same size, so every member grows at the same op.
const SymmetricMemory* agree(const ProcessGroup& group, const char* op, const at::Tensor& header, int64_t data_bytes) {
  GroupImpl& g = group.impl();
  check_usable(g, op);
  const SymmetricMemory* shown = show_header(group, op, header);
  if (shown == nullptr) return nullptr;
  for (int peer = 0; peer < g.size(); ++peer)
    if (peer != g.rank) check_header(*shown, peer, header, op, g);
  FusedWorkspace& ws = workspace_of(g);
  if (shown->bytes() < kHeaderBytes + data_bytes) {
    // Nothing is read from the old memory any more (a peer still reading a header maps it too).
    ws.memory.reset();
    if (!map_workspace(group, op, data_bytes)) return nullptr;
  }
  return &*ws.memory;
}

// Tells every peer this member has read what it needed; the next op collects their answers.
void signal_done(const ProcessGroup& group, const SymmetricMemory& memory) {
  signal_peers(memory, kDone);
  group.impl().fused_workspace->owes_done = true;
}

// Gives up the group's workspace after a failure that left the members' signals unpaired: it is
// marked unusable (agree then refuses every later op) and let go of, so that peers waiting for this
// member fail at once, naming it, instead of after the timeout.
void abandon(GroupImpl& g, const std::string& why) {
  FusedWorkspace& ws = workspace_of(g);
  if (ws.broken.empty()) ws.broken = why;
  ws.memory.reset();
}

// Runs an op's part on the workspace; a failure there abandons it.
template <typename Body>
auto on_workspace(const ProcessGroup& group, const char* op, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    abandon(group.impl(), std::string(op) + ": " + e.what());
    throw;
  }
}

// A member whose own operands are wrong (objection) still shows a header, marked refused, so that
// members that passed theirs fail at once naming it instead of waiting for it. Where every member
// refused, nothing moved and the workspace stays usable; either way this member throws objection.
// (Where the group's first op finds no room for the workspace, the members that passed their
// operands run it unfused and wait for this one in the collective until the group's timeout, as
// on any group that runs the ops unfused.)
[[noreturn]] void refuse_together(const ProcessGroup& group, const char* op, const std::string& objection) {
  GroupImpl& g = group.impl();
  check_usable(g, op);
  bool all_refused = true;
  const bool shown = on_workspace(group, op, [&] {
    const SymmetricMemory* memory = show_header(group, op, at::full({kHeaderValues}, kRefused, at::kLong));
    if (memory == nullptr) return false;
    for (int peer = 0; peer < g.size(); ++peer)
      if (peer != g.rank) all_refused = all_refused && refused(peer_header(*memory, peer));
    if (all_refused) signal_done(group, *memory);
    return true;
  });
  if (!shown || all_refused) HP_FAIL(objection);
  const std::string failure = objection + " (the other members passed their operands; they fail too, naming this one)";
  abandon(g, std::string(op) + ": " + failure);
  HP_FAIL(failure);
}

// Whether the op runs fused: on the CPU, in a group whose members share memory (shared-memory
// transport). Otherwise it runs unfused, which a group of several members says once.
bool fused_here(const ProcessGroup& group, const char* op, const at::Tensor& a) {
  GroupImpl& g = group.impl();
  if (g.size() == 1) return false;
  FusedWorkspace& ws = workspace_of(g);
  if (!ws.no_room.empty()) return false;  // said when it happened (map_workspace)
  // (An undefined `a` is an objection, shown to the peers as the fused op's would be.)
  if (!g.fake && g.shm_scope.has_value() && (!a.defined() || a.device().is_cpu())) return true;
  if (!g.fake && !ws.warned_unfused) {
    ws.warned_unfused = true;
    log::warn(op, " on ", g.describe(), " runs as the unfused collective and matmul: ",
              a.defined() && !a.device().is_cpu()
                  ? "its tensors are not on the CPU"
                  : "its members do not share memory through the shared-memory transport",
              " (async TP then adds collectives instead of saving time)");
  }
  return false;
}

// Counts an op with `data_bytes` of data that ran unfused on a fake world as a real group would
// run it fused: its workspace grows to take it (fused_workspace_bytes).
void count_as_if_fused(const ProcessGroup& group, int64_t data_bytes) {
  GroupImpl& g = group.impl();
  if (!g.fake || g.size() == 1) return;
  FusedWorkspace& ws = workspace_of(g);
  ws.fake_bytes = std::max(ws.fake_bytes, workspace_bytes(data_bytes));
}

// Why `a`, `dim` and `bs` cannot go into `op`, or "" (then `dim` is normalised: the gathered or
// scattered dim, never the contracted last one).
std::string objection_to(const char* op, const at::Tensor& a, int64_t& dim, const std::vector<at::Tensor>& bs) {
  const auto says = [&](const auto&... parts) { return ::hp::detail::str_cat(op, ": ", parts...); };
  if (!a.defined() || a.dim() < 2)
    return says("a must have rows and a contracted last dim (at least 2 dims), got ",
                a.defined() ? c10::str("shape ", a.sizes()) : std::string("an undefined tensor"));
  const int64_t d = dim < 0 ? dim + a.dim() : dim;
  if (d < 0 || d >= a.dim() - 1)
    return says("dim ", dim, " must be one of a's dims other than its last (the contracted one); a has shape ",
                a.sizes());
  for (const at::Tensor& b : bs) {
    if (!b.defined() || b.dim() != 2 || b.size(0) != a.size(-1))
      return says("b must be [K, N] with K = a's last dim (", a.size(-1), "), got ",
                  b.defined() ? c10::str("shape ", b.sizes()) : std::string("an undefined tensor"));
    if (b.scalar_type() != a.scalar_type() || b.device() != a.device())
      return says("b is ", b.scalar_type(), " on ", b.device(), " but a is ", a.scalar_type(), " on ", a.device());
  }
  dim = d;
  return "";
}

// Throws `objection` (when there is one) on this member, and, where the op would run fused, fails
// the other members at once (refuse_together).
void refuse_if(const ProcessGroup& group, const char* op, const at::Tensor& a, const std::string& objection) {
  if (objection.empty()) return;
  if (fused_here(group, op, a)) refuse_together(group, op, objection);
  HP_FAIL(objection);
}

// `t` as a matrix of its rows (every dim but the last) by its last dim.
at::Tensor as_rows(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) rows *= t.size(i);
  return t.reshape({rows, t.size(-1)});
}

std::vector<int64_t> with(std::vector<int64_t> shape, int64_t first, int64_t last) {
  shape.front() = first;
  shape.back() = last;
  return shape;
}

}  // namespace
}  // namespace detail

AllGatherMatmul all_gather_matmul(const ProcessGroup& group, const at::Tensor& a_shard,
                                  const std::vector<at::Tensor>& bs, int64_t gather_dim, bool return_gathered) {
  using namespace detail;
  const char* op = "all_gather_matmul";
  int64_t dim = gather_dim;
  refuse_if(group, op, a_shard, objection_to(op, a_shard, dim, bs));
  const int n = group.size(), me = group.rank();
  const at::Tensor moved = a_shard.movedim(dim, 0).contiguous();  // [s, rest..., K]: a member's rows are contiguous
  const int64_t s = moved.size(0);
  const std::vector<int64_t> gathered_shape = with(moved.sizes().vec(), n * s, moved.size(-1));
  AllGatherMatmul result;
  const auto put_back = [&](const at::Tensor& gathered, const std::vector<at::Tensor>& outputs) {
    if (return_gathered) result.gathered = gathered.movedim(0, dim);
    for (const at::Tensor& out : outputs) result.outputs.push_back(out.movedim(0, dim));
    return result;
  };

  const auto unfused = [&] {
    const at::Tensor gathered =
        n == 1 ? moved : group.all_gather_into_tensor(at::empty(gathered_shape, moved.options()), moved);
    std::vector<at::Tensor> outputs;
    for (const at::Tensor& b : bs) outputs.push_back(at::matmul(gathered, b));
    return put_back(gathered, outputs);
  };
  if (!fused_here(group, op, a_shard)) {
    count_as_if_fused(group, moved.nbytes());
    return unfused();
  }

  std::optional<AllGatherMatmul> fused = on_workspace(group, op, [&]() -> std::optional<AllGatherMatmul> {
    const int64_t data_bytes = moved.nbytes();
    const SymmetricMemory* workspace =
        agree(group, op, header_of(kAllGatherMatmul, dim, a_shard, bs, data_bytes), data_bytes);
    if (workspace == nullptr) return std::nullopt;
    const SymmetricMemory& memory = *workspace;
    note_collective(op, a_shard.nbytes(), n);
    memory.put(moved, me, kHeaderBytes);
    signal_peers(memory, kData);

    const at::Tensor gathered = return_gathered ? at::empty(gathered_shape, moved.options()) : at::Tensor();
    std::vector<at::Tensor> outputs;
    for (const at::Tensor& b : bs)
      outputs.push_back(at::empty(with(gathered_shape, n * s, b.size(1)), moved.options()));
    // This member's rows first (nothing to wait for), then each peer's from the next one on, so
    // that no buffer is read by every member at once.
    for (int step = 0; step < n; ++step) {
      const int from = (me + step) % n;
      at::Tensor rows = moved;
      if (from != me) {
        memory.wait_signal(from, kData);
        rows = memory.buffer(from, moved.scalar_type(), moved.sizes(), kHeaderBytes);
      }
      if (gathered.defined()) rows = gathered.narrow(0, from * s, s).copy_(rows);
      for (size_t i = 0; i < bs.size(); ++i) {
        at::Tensor place = as_rows(outputs[i].narrow(0, from * s, s));  // a view: mm_out fills it in place
        at::mm_out(place, as_rows(rows), bs[i]);
      }
    }
    signal_done(group, memory);
    return put_back(gathered, outputs);
  });
  return fused ? *std::move(fused) : unfused();
}

at::Tensor matmul_reduce_scatter(const ProcessGroup& group, const at::Tensor& a, const at::Tensor& b,
                                 int64_t scatter_dim) {
  using namespace detail;
  const char* op = "matmul_reduce_scatter";
  int64_t dim = scatter_dim;
  const int n = group.size(), me = group.rank();
  std::string objection = objection_to(op, a, dim, {b});
  if (objection.empty() && a.size(dim) % n != 0)
    objection = ::hp::detail::str_cat(op, ": a's dim ", dim, " (", a.size(dim), " of shape ", a.sizes(),
                                      ") must split into equal pieces over the group's ", n, " members");
  // Each member's buffer takes the n pieces of its rows: a whole product, which is never made
  // otherwise, so its size is checked here.
  int64_t product_bytes = a.defined() ? static_cast<int64_t>(a.element_size()) : 0;
  if (objection.empty()) {
    bool overflows = false;
    for (int64_t i = 0; i + 1 < a.dim(); ++i)
      overflows = overflows || __builtin_mul_overflow(product_bytes, a.size(i), &product_bytes);
    overflows = overflows || __builtin_mul_overflow(product_bytes, b.size(1), &product_bytes);
    if (overflows || product_bytes > kMaxDataBytes)
      objection =
          ::hp::detail::str_cat(op, ": the product of a ", a.sizes(), " and b ", b.sizes(), " is more than 2^40 bytes");
  }
  refuse_if(group, op, a, objection);
  const at::Tensor moved = a.movedim(dim, 0);  // [S, rest..., K]; member j keeps rows [j s, (j + 1) s)
  const int64_t s = moved.size(0) / n;
  const std::vector<int64_t> piece_shape = with(moved.sizes().vec(), s, b.size(1));

  const auto unfused = [&] {
    const at::Tensor product = at::matmul(moved, b).contiguous();
    if (n == 1) return product.movedim(0, dim);
    return group.reduce_scatter_tensor(at::empty(piece_shape, product.options()), product).movedim(0, dim);
  };
  if (!fused_here(group, op, a)) {
    count_as_if_fused(group, product_bytes);
    return unfused();
  }

  const int64_t piece_bytes = product_bytes / n;
  const at::Tensor fused = on_workspace(group, op, [&] {
    const SymmetricMemory* workspace =
        agree(group, op, header_of(kMatmulReduceScatter, dim, a, {b}, product_bytes), product_bytes);
    if (workspace == nullptr) return at::Tensor();
    const SymmetricMemory& memory = *workspace;
    note_collective(op, product_bytes, n);
    // The next member's rows first, this member's own last: the peers can add while it multiplies.
    for (int step = 1; step <= n; ++step) {
      const int to = (me + step) % n;
      at::Tensor place = as_rows(memory.buffer(to, a.scalar_type(), piece_shape, kHeaderBytes + me * piece_bytes));
      at::mm_out(place, as_rows(moved.narrow(0, to * s, s)), b);
      if (to != me) memory.put_signal(to, kData);
    }
    wait_for_peers(memory, kData);
    std::vector<int64_t> stacked_shape = piece_shape;
    stacked_shape.insert(stacked_shape.begin(), n);
    const at::Tensor out = at::empty(piece_shape, a.options());
    tree_reduce_(memory.buffer(me, a.scalar_type(), stacked_shape, kHeaderBytes), ReduceOp::kSum, out);
    signal_done(group, memory);
    return out.movedim(0, dim);
  });
  return fused.defined() ? fused : unfused();
}

int64_t fused_workspace_bytes(const ProcessGroup& group) {
  const detail::GroupImpl& g = group.impl();
  const detail::FusedWorkspace* ws = g.fused_workspace.get();
  if (ws == nullptr) return 0;
  if (g.fake) return ws->fake_bytes;
  return ws->memory ? ws->memory->bytes() : 0;
}

}  // namespace hp::comm
