// hp::comm::ProcessGroup: argument checks, the choice between the backend's own collective and a
// composed one, and issuing through the group's CollectiveQueue.
//
// Algorithms (n = group size):
//   all_reduce      native c10d allreduce when the backend reduces this dtype/op itself and the
//                   group is not deterministic; otherwise composed: all_to_all of torch.chunk
//                   pieces, tree_reduce of the n received pieces, all_gather of the reduced pieces.
//   reduce_scatter  always composed (Gloo has none): all_to_all, then tree_reduce.
//   all_gather      native allgather into one buffer; uneven sizes are padded to the largest.
//   all_to_all, broadcast, send/recv, barrier: native.
// Data the backend cannot carry (bf16 on Gloo) travels reinterpreted as a same-width dtype (shim::to_wire).
// A fake world's groups (fake_world) move nothing: comm/fake_collectives.h gives the results.
// On a group with the shared-memory transport (comm/shm_channel.h), every collective is composed:
// all_gather, all_to_all and broadcast move bytes through the shared segment, and the reductions
// are the composed ones above on top of them (so always in the tree order); send/recv stay on Gloo.
// A reduction in a low-precision wire format (WireFormat, comm/wire_codec.h) is always composed:
// the all_to_all carries the encoded pieces, and each member adds what it decodes in fp32.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "comm/fake_collectives.h"
#include "comm/fake_exchange.h"
#include "comm/group_impl.h"
#include "comm/shm_channel.h"
#include "comm/wire_codec.h"
#include "hp/comm/comm_debug_mode.h"
#include "hp/comm/init.h"
#include "hp/comm/tree_reduce.h"
#include "hp/comm/wire_format.h"
#include "hp/core/chunking.h"
#include "hp/core/error.h"
#include "hp/core/memory_timeline.h"

namespace hp::comm {

using detail::ByteSpan;
using detail::CollectiveSite;
using detail::GroupImpl;
using detail::ShmChannel;

namespace {

// One native collective: `start` issues it, `finish` turns its buffers into the result.
struct Step {
  std::function<shim::NativeWork()> start;
  std::function<at::Tensor()> finish;
};

int64_t sum_of(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

std::vector<int64_t> with_dim0(const at::Tensor& t, int64_t rows) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape[0] = rows;
  return shape;
}

int64_t normalize_dim(const char* op, int64_t dim, const at::Tensor& t) {
  const int64_t rank = t.dim();
  HP_CHECK(rank > 0, op, ": needs a tensor with at least one dim, got a scalar");
  HP_CHECK(dim >= -rank && dim < rank, op, ": dim ", dim, " is out of range for a tensor of shape ", t.sizes());
  return dim < 0 ? dim + rank : dim;
}

at::Tensor to_dim0(const at::Tensor& t, int64_t dim) { return (dim == 0 ? t : t.movedim(dim, 0)).contiguous(); }
at::Tensor from_dim0(const at::Tensor& t, int64_t dim) { return dim == 0 ? t : t.movedim(0, dim).contiguous(); }

void check_tensor(const char* op, const at::Tensor& t, const GroupImpl& g) {
  HP_CHECK(t.defined(), op, ": got an undefined tensor");
  if (g.fake && t.is_meta()) return;
  HP_CHECK(t.device().is_cpu() || t.device().is_cuda(), op, ": tensors on ", t.device(),
           " are not supported; use CPU (Gloo) or CUDA (NCCL)",
           t.is_meta() ? " (meta tensors are accepted only by hp::comm::fake_world groups)" : "");
}

void check_reducible(const char* op, const at::Tensor& t, ReduceOp r) {
  HP_CHECK(t.scalar_type() != at::kBool && !t.is_complex(), op, ": cannot reduce dtype ", t.scalar_type(),
           "; use a floating-point or integer dtype");
  HP_CHECK(r != ReduceOp::kAvg || t.is_floating_point(), op, ": ReduceOp avg needs a floating-point dtype, got ",
           t.scalar_type());
}

void check_wire(const char* op, const at::Tensor& t, ReduceOp r, WireFormat wire) {
  if (wire == WireFormat::kNative) return;
  const at::ScalarType dtype = t.scalar_type();
  HP_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": wire format ", to_string(wire),
           " carries fp32, bf16 or fp16 tensors, got ", dtype);
  HP_CHECK(r == ReduceOp::kSum || r == ReduceOp::kAvg, op, ": wire format ", to_string(wire), " is for sum and avg; ",
           to_string(r), " is exact in the native format");
  HP_CHECK(t.device().is_cpu() || t.is_meta(), op, ": wire format ", to_string(wire),
           " is emulated on the CPU; this tensor is on ", t.device(), " (use the native format)");
}

int64_t row_numel(const at::Tensor& t) {
  int64_t numel = 1;
  for (int64_t d = 1; d < t.dim(); ++d) numel *= t.size(d);
  return numel;
}

// The values in pieces of sizes[r] rows of `row` values each.
std::vector<int64_t> values_in_rows(std::vector<int64_t> sizes, int64_t row) {
  for (int64_t& s : sizes) s *= row;
  return sizes;
}

// The bytes pieces of counts[r] values take on a low-precision wire.
std::vector<int64_t> wire_bytes_of(WireFormat wire, const std::vector<int64_t>& counts) {
  std::vector<int64_t> bytes;
  for (int64_t count : counts) bytes.push_back(wire_bytes(wire, count));
  return bytes;
}

// A new output of a shared-memory collective, its pages mapped in one call (MADV_POPULATE_WRITE)
// rather than by one page fault each as the received bytes land: on a virtual machine a fault
// taken in user space costs microseconds (bench/RESULTS.md). Before Linux 5.14 the call fails and
// the pages fault in as before.
at::Tensor populated(at::Tensor t) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t first = (begin + page - 1) / page * page, last = (begin + t.nbytes()) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_WRITE);
  return t;
}

// Gathers dim-0 pieces of sizes[r] rows from every rank r (x0 holds this rank's, contiguous) into
// `buffer` (contiguous, n * max(sizes) rows) or a new tensor.
Step all_gather_step(GroupImpl& g, const at::Tensor& x0, const std::vector<int64_t>& sizes, at::Tensor buffer = {}) {
  const int n = g.size();
  const int64_t widest = *std::max_element(sizes.begin(), sizes.end());
  const bool even = std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == widest; });
  at::Tensor padded =
      x0.size(0) == widest ? x0 : at::cat({x0, at::zeros(with_dim0(x0, widest - x0.size(0)), x0.options())});
  at::Tensor out = buffer.defined() ? buffer : at::empty(with_dim0(x0, widest * n), x0.options());
  Step step;
  if (out.numel() > 0) {
    step.start = [&g, out, padded, n] {
      std::vector<at::Tensor> outs;
      for (const at::Tensor& piece : out.chunk(n)) outs.push_back(shim::to_wire(*g.native, piece));
      return shim::all_gather(*g.native, std::move(outs), shim::to_wire(*g.native, padded));
    };
  } else {
    step.start = [] { return shim::NativeWork(); };
  }
  step.finish = [out, sizes, widest, even] {
    if (even) return out;
    std::vector<at::Tensor> pieces;
    for (size_t r = 0; r < sizes.size(); ++r) pieces.push_back(out.narrow(0, r * widest, sizes[r]));
    return at::cat(pieces);
  };
  return step;
}

Step all_to_all_step(GroupImpl& g, const at::Tensor& input, const std::vector<int64_t>& out_splits,
                     const std::vector<int64_t>& in_splits, at::Tensor buffer = {}) {
  at::Tensor in = input.contiguous();
  at::Tensor out = buffer.defined() ? buffer : at::empty(with_dim0(in, sum_of(out_splits)), in.options());
  Step step;
  step.start = [&g, in, out, out_splits, in_splits] {
    return shim::all_to_all(*g.native, shim::to_wire(*g.native, out), shim::to_wire(*g.native, in), out_splits,
                            in_splits);
  };
  step.finish = [out] { return out; };
  return step;
}

// Runs a step to completion inside a composed collective (on the queue's worker).
at::Tensor run_step(const CollectiveSite& site, const Step& step) {
  detail::wait_native(site, step.start());
  return step.finish();
}

// Backend rejections at issue time are bad input, not a peer failure: no store exchange.
shim::NativeWork start_or_explain(const CollectiveSite& site, const Step& step) {
  try {
    return step.start();
  } catch (const c10::Error& e) {
    throw hp::Error(std::string(site.op) + " on " + site.group->describe() +
                    ": the backend rejected the call: " + e.what_without_backtrace());
  }
}

// ---- Data movement: through shared memory when the group has it, else one native collective ----

// Whether collectives of `t` on `g` go through shared memory (host memory only).
bool over_shm(const GroupImpl& g, const at::Tensor& t) { return g.shm_scope.has_value() && t.device().is_cpu(); }

int64_t row_bytes(const at::Tensor& t) { return t.element_size() * row_numel(t); }

// `count` pieces of a contiguous tensor's rows, piece r `sizes[r]` rows long, back to back.
std::vector<ByteSpan> row_spans(const at::Tensor& t, const std::vector<int64_t>& sizes) {
  auto* base = static_cast<std::byte*>(t.data_ptr());
  const int64_t row = row_bytes(t);
  std::vector<ByteSpan> spans;
  int64_t offset = 0;
  for (int64_t rows : sizes) {
    spans.push_back({rows > 0 ? base + offset * row : nullptr, rows * row});
    offset += rows;
  }
  return spans;
}

// Gathers dim-0 pieces of sizes[r] rows from every rank r (x0 holds this rank's, contiguous), in
// rank order; into `buffer` (contiguous, at least n * max(sizes) rows; through shared memory,
// sum(sizes) rows are enough) when given.
at::Tensor gather_rows(const CollectiveSite& site, const at::Tensor& x0, const std::vector<int64_t>& sizes,
                       const at::Tensor& buffer = {}) {
  GroupImpl& g = *site.group;
  if (!over_shm(g, x0)) return run_step(site, all_gather_step(g, x0, sizes, buffer));
  const int64_t rows = sum_of(sizes);
  at::Tensor out =
      buffer.defined() ? buffer.narrow(0, 0, rows) : populated(at::empty(with_dim0(x0, rows), x0.options()));
  g.shm_channel(site).gather(site, {static_cast<std::byte*>(x0.data_ptr()), static_cast<int64_t>(x0.nbytes())},
                             row_spans(out, sizes));
  return out;
}

// Sends in_splits[r] rows of `input` to rank r and receives out_splits[r] rows from it, in rank
// order; into `buffer` (contiguous, sum(out_splits) rows) when given.
at::Tensor exchange_rows(const CollectiveSite& site, const at::Tensor& input, const std::vector<int64_t>& out_splits,
                         const std::vector<int64_t>& in_splits, const at::Tensor& buffer = {}) {
  GroupImpl& g = *site.group;
  if (!over_shm(g, input)) return run_step(site, all_to_all_step(g, input, out_splits, in_splits, buffer));
  at::Tensor in = input.contiguous();
  at::Tensor out = buffer.defined() ? buffer : populated(at::empty(with_dim0(in, sum_of(out_splits)), in.options()));
  g.shm_channel(site).exchange(site, row_spans(in, in_splits), row_spans(out, out_splits));
  return out;
}

// Every collective takes the group's next sequence number (failure reports match ranks by it)
// and is counted by the caller's CommDebugMode, with the bytes this rank puts in (and whether they
// travel in a low-precision wire format).
CollectiveSite new_site(GroupImpl& g, const char* op, int64_t bytes, WireFormat wire = WireFormat::kNative) {
  note_collective(op, bytes, g.size(), wire != WireFormat::kNative);
  return CollectiveSite{&g, op, g.next_seq++};
}

// Point-to-point messages involve two ranks only, so they stay out of the group's collective
// sequence (which must be equal on all members).
CollectiveSite new_p2p_site(GroupImpl& g, const char* op, int64_t bytes, int peer, int tag) {
  note_collective(op, bytes, g.size());
  return CollectiveSite{&g, op, 0, peer, tag};
}

Work issue_native(const std::shared_ptr<GroupImpl>& g, const CollectiveSite& site, Step step) {
  auto state = std::make_shared<detail::NativeWorkState>(site, step.finish);
  state->keep_alive = g;
  // On a shared-memory group the queue holds collectives that move no Gloo data, and Gloo matches
  // point-to-point messages by peer and tag, not by their place among the collectives: they start at
  // once. Behind a queued collective, a send could wait for the very collective its receiver can
  // only join after receiving it (a pipeline stage and its peer; found with ep x pp). A native
  // collective (of GPU tensors) still keeps its place in the program order, behind the queue.
  if (g->shm_scope && site.peer >= 0) {
    state->work = start_or_explain(site, step);
    return Work(state);
  }
  if (g->queue.issue_if_idle([&] { state->work = start_or_explain(site, step); })) return Work(state);
  // Behind a composed collective: issue from the worker so the issue order stays the program order.
  // The worker only starts it and goes on: waiting there would keep a send's matching receive (the
  // next operation of a batch_isend_irecv, on both ranks) from being posted.
  auto abort_requested = std::make_shared<std::atomic<bool>>(false);
  std::shared_future<at::Tensor> started = g->queue.enqueue([state, site, step, abort_requested] {
    state->work = start_or_explain(site, step);
    if (*abort_requested) state->abort(state);
    return at::Tensor();
  });
  return Work(std::make_shared<detail::StartedLaterWorkState>(std::move(started), std::move(state),
                                                              std::move(abort_requested)));
}

// A native collective that fills `tensor` in place, through a contiguous copy when it is not.
Step in_place_step(const at::Tensor& tensor, std::function<shim::NativeWork(const at::Tensor&)> start) {
  at::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  Step step;
  step.start = [start = std::move(start), buffer] { return start(buffer); };
  step.finish = [tensor, buffer] {
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    return tensor;
  };
  return step;
}

void check_peer(const char* op, const GroupImpl& g, int peer) {
  HP_CHECK(peer >= 0 && peer < g.size() && peer != g.rank, op, ": peer ", peer, " must be another rank of ",
           g.describe(), " (this is rank ", g.rank, ")");
}

Work ready(at::Tensor t) { return Work(std::make_shared<detail::ReadyWorkState>(std::move(t))); }

// The buffers of a composed reduction of `like` in pieces of counts[r] values (this rank receives
// `received` values from each member), which a fake world's group allocates as a real one would,
// for a dry run's memory report: the receive buffer the group keeps; on a wire also, held together
// as reduce_scatter_on_wire holds them, the encoded input, the fp32 sum and the decoded columns.
void reserve_reduction_buffers(GroupImpl& g, const at::Tensor& like, const std::vector<int64_t>& counts,
                               int64_t received, WireFormat wire) {
  if (wire == WireFormat::kNative) {
    g.scratch({g.size() * received}, like.scalar_type(), like.device());
    return;
  }
  const auto on_its_device = [&](at::ScalarType dtype) {
    return at::TensorOptions().dtype(dtype).device(like.device());
  };
  const at::Tensor encoded = at::empty({sum_of(wire_bytes_of(wire, counts))}, on_its_device(at::kByte));
  const at::Tensor pieces = g.scratch({g.size() * wire_bytes(wire, received)}, at::kByte, like.device());
  const at::Tensor sum = at::empty({received}, on_its_device(at::kFloat));
  const at::Tensor decoded =
      at::empty({g.size(), std::min(received, detail::kCodecChunkValues)}, on_its_device(at::kFloat));
}

// A collective of a fake world's group: counted and numbered like any other, done at once.
Work fake_result(GroupImpl& g, const char* op, int64_t bytes, at::Tensor result,
                 WireFormat wire = WireFormat::kNative) {
  new_site(g, op, bytes, wire);
  return ready(std::move(result));
}

enum class Wait { kAsync, kBlocking };

Work issue_composed(const std::shared_ptr<GroupImpl>& g, const char* op, int64_t bytes, Wait wait,
                    std::function<at::Tensor(const CollectiveSite&)> run, WireFormat wire = WireFormat::kNative) {
  const CollectiveSite site = new_site(*g, op, bytes, wire);
  if (wait == Wait::kBlocking) {
    if (auto done = g->queue.run_if_idle([&] { return run(site); })) return ready(*done);
  }
  return Work(std::make_shared<detail::QueuedWorkState>(
      g->queue.enqueue([site, run = std::move(run), keep_alive = g] { return run(site); })));
}

// Reduce-scatter through shared memory: each round's pieces are reduced where they lie in the
// members' slots, by the same tree, so to the same bits, without being copied out first.
at::Tensor reduce_scatter_in_place(ShmChannel& shm, const CollectiveSite& site, const at::Tensor& x0,
                                   const std::vector<int64_t>& sizes, ReduceOp op, const at::Tensor& out) {
  const int n = site.group->size();
  const int64_t mine = sizes[site.group->rank];
  at::Tensor result = out.defined() ? out : populated(at::empty(with_dim0(x0, mine), x0.options()));
  at::Tensor flat = result.is_contiguous() ? result.view({-1}) : at::empty({result.numel()}, x0.options());
  const int64_t element = x0.element_size();
  const int64_t member_stride = 2 * ShmChannel::slot_bytes() / element;
  shm.exchange_and_consume(
      site, row_spans(x0, sizes), mine * row_bytes(x0), [&](const std::vector<ByteSpan>& received, int64_t offset) {
        const int64_t count = received[0].size / element;
        if (count == 0) return;
        at::Tensor stacked = at::from_blob(received[0].data, {n, count}, {member_stride, 1}, x0.options());
        tree_reduce_(stacked, op, flat.narrow(0, offset / element, count));
      });
  if (!result.is_contiguous()) result.copy_(flat.view(result.sizes()));
  return result;
}

// Reduce-scatter in a low-precision wire format: every piece is encoded, the encoded pieces are
// exchanged as bytes, and each member decodes the n pieces it received and adds them in fp32 by
// the tree, casting once to the input's dtype (or into `out`).
at::Tensor reduce_scatter_on_wire(const CollectiveSite& site, const at::Tensor& x0, const std::vector<int64_t>& sizes,
                                  ReduceOp op, WireFormat wire, const at::Tensor& out) {
  GroupImpl& g = *site.group;
  const int n = g.size();
  const std::vector<int64_t> counts = values_in_rows(sizes, row_numel(x0));
  const std::vector<int64_t> sent = wire_bytes_of(wire, counts);
  const at::Tensor flat = x0.reshape({-1});  // x0 is contiguous
  at::Tensor encoded = at::empty({sum_of(sent)}, at::kByte);
  auto* to = reinterpret_cast<std::byte*>(encoded.data_ptr<uint8_t>());
  int64_t offset = 0;
  for (int r = 0; r < n; ++r) {
    detail::encode_piece(wire, flat.narrow(0, offset, counts[r]), to);
    offset += counts[r];
    to += sent[r];
  }
  const int64_t count = counts[g.rank], bytes = sent[g.rank];
  const at::Tensor received =
      exchange_rows(site, encoded, std::vector<int64_t>(n, bytes), sent, g.scratch({n * bytes}, at::kByte));
  const auto* pieces = reinterpret_cast<const std::byte*>(received.data_ptr<uint8_t>());
  at::Tensor sum = at::empty({count}, at::kFloat);
  // Decoded and added by columns: the fp32 values of n pieces are never all held at once.
  at::Tensor decoded = at::empty({n, std::min(count, detail::kCodecChunkValues)}, at::kFloat);
  for (int64_t begin = 0; begin < count; begin += detail::kCodecChunkValues) {  // per value, the same tree
    const int64_t length = std::min(detail::kCodecChunkValues, count - begin);
    at::Tensor columns = decoded.narrow(1, 0, length);
    for (int r = 0; r < n; ++r)
      detail::decode_piece(wire, pieces + r * bytes, count, begin, length, columns[r].data_ptr<float>());
    tree_reduce_(columns, op, sum.narrow(0, begin, length));
  }
  sum = sum.view(with_dim0(x0, sizes[g.rank]));
  return out.defined() ? out.copy_(sum) : sum.to(x0.scalar_type());
}

// Reduce-scatter of dim-0 pieces (sizes[r] rows for rank r) as all_to_all + tree_reduce, into
// `out` when given.
at::Tensor reduce_scatter_dim0(const CollectiveSite& site, const at::Tensor& x0, const std::vector<int64_t>& sizes,
                               ReduceOp op, WireFormat wire, const at::Tensor& out = {}) {
  GroupImpl& g = *site.group;
  if (wire != WireFormat::kNative) return reduce_scatter_on_wire(site, x0, sizes, op, wire, out);
  if (over_shm(g, x0)) return reduce_scatter_in_place(g.shm_channel(site), site, x0, sizes, op, out);
  const int64_t mine = sizes[g.rank];
  std::vector<int64_t> stacked_shape{g.size()};
  for (int64_t d : with_dim0(x0, mine)) stacked_shape.push_back(d);
  at::Tensor buffer = g.scratch(with_dim0(x0, g.size() * mine), x0.scalar_type());
  at::Tensor received = exchange_rows(site, x0, std::vector<int64_t>(g.size(), mine), sizes, buffer);
  return tree_reduce_(received.view(stacked_shape), op, out);  // `received` is our scratch
}

Work all_reduce_impl(const std::shared_ptr<GroupImpl>& impl, const at::Tensor& tensor, AllReduceOptions opts,
                     Wait wait) {
  const MemoryLabel communication(MemoryLabel::kCommunication);  // its buffers, for a dry run's report
  GroupImpl& g = *impl;
  check_tensor("all_reduce", tensor, g);
  check_reducible("all_reduce", tensor, opts.op);
  check_wire("all_reduce", tensor, opts.op, opts.wire);
  const int n = g.size();
  if (n == 1) return ready(tensor);
  const bool on_wire = opts.wire != WireFormat::kNative;

  const bool ordered_sum =
      g.options.deterministic && tensor.is_floating_point() && (opts.op == ReduceOp::kSum || opts.op == ReduceOp::kAvg);
  const ReduceOp native_op = opts.op == ReduceOp::kAvg ? ReduceOp::kSum : opts.op;
  // A fake world stands for Gloo, and keeps the buffers Gloo's composed path would.
  const bool backend_reduces = g.fake ? shim::gloo_reduces(tensor.scalar_type(), native_op)
                                      : shim::can_reduce(*g.native, tensor.scalar_type(), native_op);
  if (g.fake) {
    // On a wire: the reduce-scatter leg's buffers, then the gather leg's receive buffer (the larger).
    const std::vector<int64_t> pieces = chunk_sizes(tensor.numel(), n);
    if (on_wire) reserve_reduction_buffers(g, tensor, pieces, pieces[g.rank], opts.wire);
    if (ordered_sum || !backend_reduces || on_wire)  // pieces[0] is the widest
      reserve_reduction_buffers(g, tensor, pieces, pieces[0], WireFormat::kNative);
    return fake_result(g, "all_reduce", tensor.nbytes(), detail::fake::all_reduce(tensor, opts.op, n), opts.wire);
  }
  if (!ordered_sum && !on_wire && !over_shm(g, tensor) && backend_reduces) {
    Step step = in_place_step(
        tensor, [&g, native_op](const at::Tensor& buffer) { return shim::all_reduce(*g.native, buffer, native_op); });
    if (opts.op == ReduceOp::kAvg) step.finish = [reduced = step.finish, n] { return reduced().div_(n); };
    return issue_native(impl, new_site(*impl, "all_reduce", tensor.nbytes()), std::move(step));
  }
  return issue_composed(
      impl, "all_reduce", tensor.nbytes(), wait,
      [tensor, op = opts.op, wire = opts.wire](const CollectiveSite& site) {
        GroupImpl& g = *site.group;
        const std::vector<int64_t> pieces = chunk_sizes(tensor.numel(), g.size());
        at::Tensor mine = reduce_scatter_dim0(site, tensor.reshape({-1}), pieces, op, wire);
        if (tensor.is_contiguous() && over_shm(g, tensor)) {
          gather_rows(site, mine, pieces, tensor.view({-1}));  // straight into place
          return tensor;
        }
        at::Tensor gather_buffer = g.scratch({pieces[0] * g.size()}, tensor.scalar_type());  // pieces[0] is the widest
        at::Tensor full = gather_rows(site, mine, pieces, gather_buffer);
        tensor.copy_(full.view(tensor.sizes()));  // copied out at once: `full` may alias the scratch buffer
        return tensor;
      },
      opts.wire);
}

Work reduce_scatter_impl(const std::shared_ptr<GroupImpl>& impl, const at::Tensor& input, ReduceScatterOptions opts,
                         Wait wait, const at::Tensor& out = {}) {
  const MemoryLabel communication(MemoryLabel::kCommunication);  // its buffers, for a dry run's report
  GroupImpl& g = *impl;
  check_tensor("reduce_scatter", input, g);
  check_reducible("reduce_scatter", input, opts.op);
  check_wire("reduce_scatter", input, opts.op, opts.wire);
  const int64_t dim = normalize_dim("reduce_scatter", opts.dim, input);
  std::vector<int64_t> sizes = opts.sizes.empty() ? chunk_sizes(input.size(dim), g.size()) : opts.sizes;
  HP_CHECK(static_cast<int>(sizes.size()) == g.size(), "reduce_scatter: sizes has ", sizes.size(), " entries but ",
           g.describe(), " has ", g.size(), " ranks");
  HP_CHECK(sum_of(sizes) == input.size(dim), "reduce_scatter: sizes add up to ", sum_of(sizes),
           " but the input has size ", input.size(dim), " along dim ", dim);
  std::vector<int64_t> piece_shape(input.sizes().begin(), input.sizes().end());
  piece_shape[dim] = sizes[g.rank];
  if (out.defined()) {
    check_tensor("reduce_scatter_tensor", out, g);
    HP_CHECK(out.device() == input.device(), "reduce_scatter_tensor: output is on ", out.device(),
             " but the input is on ", input.device());
    HP_CHECK(out.sizes() == at::IntArrayRef(piece_shape) && out.scalar_type() == input.scalar_type(),
             "reduce_scatter_tensor: output is ", out.sizes(), " ", out.scalar_type(), " but this rank's piece is ",
             at::IntArrayRef(piece_shape), " ", input.scalar_type());
  }
  if (g.size() == 1) return ready(out.defined() ? out.copy_(input) : input.clone());
  at::Tensor x0 = to_dim0(input, dim);
  if (g.fake) {
    const std::vector<int64_t> counts = values_in_rows(sizes, row_numel(x0));
    reserve_reduction_buffers(g, x0, counts, counts[g.rank], opts.wire);
    at::Tensor piece = from_dim0(detail::fake::reduce_scatter(x0, sizes, g.rank, opts.op, g.size()), dim);
    return fake_result(g, "reduce_scatter", input.nbytes(), out.defined() ? out.copy_(piece) : piece, opts.wire);
  }
  return issue_composed(
      impl, "reduce_scatter", input.nbytes(), wait,
      [x0, sizes, dim, op = opts.op, wire = opts.wire, out](const CollectiveSite& site) {
        if (out.defined()) {
          reduce_scatter_dim0(site, x0, sizes, op, wire, dim == 0 ? out : out.movedim(dim, 0));
          return out;
        }
        return from_dim0(reduce_scatter_dim0(site, x0, sizes, op, wire), dim);
      },
      opts.wire);
}

Work all_gather_impl(const std::shared_ptr<GroupImpl>& impl, const at::Tensor& input, AllGatherOptions opts, Wait wait,
                     const at::Tensor& out = {}) {
  const MemoryLabel communication(MemoryLabel::kCommunication);  // its buffers, for a dry run's report
  GroupImpl& g = *impl;
  check_tensor("all_gather", input, g);
  const int64_t dim = normalize_dim("all_gather", opts.dim, input);
  std::vector<int64_t> sizes = opts.sizes;
  if (sizes.empty()) sizes.assign(g.size(), input.size(dim));
  HP_CHECK(static_cast<int>(sizes.size()) == g.size(), "all_gather: sizes has ", sizes.size(), " entries but ",
           g.describe(), " has ", g.size(), " ranks");
  HP_CHECK(sizes[g.rank] == input.size(dim), "all_gather: sizes[", g.rank, "] = ", sizes[g.rank],
           " but this rank's input has size ", input.size(dim), " along dim ", dim);
  std::vector<int64_t> gathered_shape(input.sizes().begin(), input.sizes().end());
  gathered_shape[dim] = sum_of(sizes);
  const bool even = std::all_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s == sizes[0]; });
  at::Tensor buffer;  // receive straight into `out` when its layout is the gather buffer's
  if (out.defined()) {
    check_tensor("all_gather_into_tensor", out, g);
    HP_CHECK(out.device() == input.device(), "all_gather_into_tensor: output is on ", out.device(),
             " but the input is on ", input.device());
    HP_CHECK(out.sizes() == at::IntArrayRef(gathered_shape) && out.scalar_type() == input.scalar_type(),
             "all_gather_into_tensor: output is ", out.sizes(), " ", out.scalar_type(), " but the gathered tensor is ",
             at::IntArrayRef(gathered_shape), " ", input.scalar_type());
    if (dim == 0 && even && out.is_contiguous()) buffer = out;
  }
  if (g.size() == 1) return ready(out.defined() ? out.copy_(input) : input);
  if (g.fake) {
    at::Tensor gathered = detail::fake::all_gather(to_dim0(input, dim), sizes, buffer);
    if (buffer.defined()) return fake_result(g, "all_gather", input.nbytes(), out);
    gathered = from_dim0(gathered, dim);
    return fake_result(g, "all_gather", input.nbytes(), out.defined() ? out.copy_(gathered) : gathered);
  }
  if (over_shm(g, input)) {
    return issue_composed(impl, "all_gather", input.nbytes(), wait,
                          [x0 = to_dim0(input, dim), sizes, dim, out, buffer](const CollectiveSite& site) {
                            at::Tensor gathered = gather_rows(site, x0, sizes, buffer);
                            if (buffer.defined()) return out;
                            at::Tensor result = from_dim0(gathered, dim);
                            return out.defined() ? out.copy_(result) : result;
                          });
  }
  Step step = all_gather_step(g, to_dim0(input, dim), sizes, buffer);
  step.finish = [gathered = step.finish, dim, out, buffer] {
    if (buffer.defined()) return gathered();
    at::Tensor result = from_dim0(gathered(), dim);
    return out.defined() ? out.copy_(result) : result;
  };
  return issue_native(impl, new_site(*impl, "all_gather", input.nbytes()), std::move(step));
}

Work all_to_all_impl(const std::shared_ptr<GroupImpl>& impl, const at::Tensor& input, AllToAllOptions opts, Wait wait) {
  const MemoryLabel communication(MemoryLabel::kCommunication);  // its buffers, for a dry run's report
  GroupImpl& g = *impl;
  check_tensor("all_to_all", input, g);
  HP_CHECK(input.dim() > 0, "all_to_all: needs a tensor with at least one dim, got a scalar");
  const int n = g.size();
  HP_CHECK(opts.input_split_sizes.empty() == opts.output_split_sizes.empty(),
           "all_to_all: give both input_split_sizes and output_split_sizes, or neither (even split)");
  if (opts.input_split_sizes.empty()) {
    HP_CHECK(input.size(0) % n == 0, "all_to_all: dim 0 of size ", input.size(0), " does not split evenly over ", n,
             " ranks; pass split sizes");
    opts.input_split_sizes.assign(n, input.size(0) / n);
    opts.output_split_sizes = opts.input_split_sizes;
  }
  for (const auto* splits : {&opts.input_split_sizes, &opts.output_split_sizes}) {
    HP_CHECK(static_cast<int>(splits->size()) == n, "all_to_all: split sizes need ", n, " entries (one per rank of ",
             g.describe(), "), got ", splits->size());
    HP_CHECK(std::all_of(splits->begin(), splits->end(), [](int64_t s) { return s >= 0; }),
             "all_to_all: split sizes must be non-negative");
  }
  HP_CHECK(sum_of(opts.input_split_sizes) == input.size(0), "all_to_all: input_split_sizes add up to ",
           sum_of(opts.input_split_sizes), " but dim 0 of the input is ", input.size(0));
  HP_CHECK(opts.input_split_sizes[g.rank] == opts.output_split_sizes[g.rank], "all_to_all: this rank (", g.rank,
           ") sends itself ", opts.input_split_sizes[g.rank], " rows but expects ", opts.output_split_sizes[g.rank],
           " from itself");
  if (n == 1) return ready(input.clone());
  if (g.fake)
    return fake_result(g, "all_to_all", input.nbytes(),
                       detail::fake::all_to_all(input, opts.output_split_sizes, opts.input_split_sizes, g.rank));
  if (over_shm(g, input)) {
    return issue_composed(
        impl, "all_to_all", input.nbytes(), wait,
        [input, out_splits = opts.output_split_sizes, in_splits = opts.input_split_sizes](const CollectiveSite& site) {
          return exchange_rows(site, input, out_splits, in_splits);
        });
  }
  return issue_native(impl, new_site(g, "all_to_all", input.nbytes()),
                      all_to_all_step(g, input, opts.output_split_sizes, opts.input_split_sizes));
}

Work broadcast_impl(const std::shared_ptr<GroupImpl>& impl, const at::Tensor& tensor, int root, Wait wait) {
  const MemoryLabel communication(MemoryLabel::kCommunication);  // its buffers, for a dry run's report
  GroupImpl& g = *impl;
  check_tensor("broadcast", tensor, g);
  HP_CHECK(root >= 0 && root < g.size(), "broadcast: root ", root, " is not a rank of ", g.describe());
  if (g.size() == 1) return ready(tensor);
  if (g.fake) return fake_result(g, "broadcast", tensor.nbytes(), tensor);
  if (over_shm(g, tensor)) {
    return issue_composed(impl, "broadcast", tensor.nbytes(), wait, [tensor, root](const CollectiveSite& site) {
      GroupImpl& g = *site.group;
      at::Tensor buffer = tensor.contiguous();
      const ByteSpan bytes{static_cast<std::byte*>(buffer.data_ptr()), static_cast<int64_t>(buffer.nbytes())};
      std::vector<ByteSpan> recvs(g.size());
      recvs[root] = bytes;
      g.shm_channel(site).gather(site, g.rank == root ? bytes : ByteSpan{}, recvs);
      if (!buffer.is_same(tensor)) tensor.copy_(buffer);
      return tensor;
    });
  }
  Step step = in_place_step(tensor, [&g, root](const at::Tensor& buffer) {
    return shim::broadcast(*g.native, shim::to_wire(*g.native, buffer), root);
  });
  return issue_native(impl, new_site(g, "broadcast", tensor.nbytes()), std::move(step));
}

Work barrier_impl(const std::shared_ptr<GroupImpl>& impl, Wait wait) {
  const MemoryLabel communication(MemoryLabel::kCommunication);  // its buffers, for a dry run's report
  GroupImpl& g = *impl;
  if (g.size() == 1) return ready(at::Tensor());
  if (g.fake) return fake_result(g, "barrier", 0, at::Tensor());
  if (g.shm_scope) {
    return issue_composed(impl, "barrier", 0, wait, [](const CollectiveSite& site) {
      site.group->shm_channel(site).barrier(site);
      return at::Tensor();
    });
  }
  Step step;
  step.start = [&g] { return shim::barrier(*g.native); };
  step.finish = [] { return at::Tensor(); };
  return issue_native(impl, new_site(g, "barrier", 0), std::move(step));
}

}  // namespace

namespace detail {

at::Tensor GroupImpl::scratch(at::IntArrayRef shape, at::ScalarType dtype, c10::Device device) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes > kMaxCachedScratchBytes) return at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
  if (!scratch_storage.defined() || scratch_storage.numel() < bytes || scratch_storage.device() != device)
    scratch_storage = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  return scratch_storage.narrow(0, 0, bytes).view(dtype).view(shape);
}

}  // namespace detail

// ---- Work ---------------------------------------------------------------------------------------

at::Tensor Work::wait() {
  HP_CHECK(state_, "Work::wait: this Work was default-constructed and refers to no collective");
  return state_->wait();
}

bool Work::is_completed() const { return !state_ || state_->is_completed(); }

void Work::abort() {
  if (state_) state_->abort(state_);
}

// ---- ProcessGroup -------------------------------------------------------------------------------

detail::GroupImpl& ProcessGroup::impl() const {
  HP_CHECK(impl_,
           "ProcessGroup: this handle is empty; create groups with init_process_group, "
           "new_group or a DeviceMesh");
  return *impl_;
}

GroupStore ProcessGroup::store() const {
  impl();  // the empty-handle error
  return GroupStore(impl_);
}

int ProcessGroup::rank() const { return impl().rank; }
int ProcessGroup::size() const { return impl().size(); }
const std::string& ProcessGroup::name() const { return impl().name; }
const std::vector<int>& ProcessGroup::ranks() const { return impl().ranks; }
const ProcessGroupOptions& ProcessGroup::options() const { return impl().options; }
bool is_fake(const ProcessGroup& group) { return group.impl().fake; }

Work ProcessGroup::all_gather_async(const at::Tensor& input, AllGatherOptions opts) const {
  return all_gather_impl(impl_, input, std::move(opts), Wait::kAsync);
}
Work ProcessGroup::all_gather_into_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                                AllGatherOptions opts) const {
  HP_CHECK(output.defined(), "all_gather_into_tensor: got an undefined output tensor");
  return all_gather_impl(impl_, input, std::move(opts), Wait::kAsync, output);
}
at::Tensor ProcessGroup::all_gather_into_tensor(const at::Tensor& output, const at::Tensor& input,
                                                AllGatherOptions opts) const {
  HP_CHECK(output.defined(), "all_gather_into_tensor: got an undefined output tensor");
  return all_gather_impl(impl_, input, std::move(opts), Wait::kBlocking, output).wait();
}

Work ProcessGroup::all_reduce_async(const at::Tensor& tensor, AllReduceOptions opts) const {
  return all_reduce_impl(impl_, tensor, opts, Wait::kAsync);
}
at::Tensor ProcessGroup::all_reduce(const at::Tensor& tensor, AllReduceOptions opts) const {
  return all_reduce_impl(impl_, tensor, opts, Wait::kBlocking).wait();
}
Work ProcessGroup::reduce_scatter_async(const at::Tensor& input, ReduceScatterOptions opts) const {
  return reduce_scatter_impl(impl_, input, std::move(opts), Wait::kAsync);
}
at::Tensor ProcessGroup::reduce_scatter(const at::Tensor& input, ReduceScatterOptions opts) const {
  return reduce_scatter_impl(impl_, input, std::move(opts), Wait::kBlocking).wait();
}
Work ProcessGroup::reduce_scatter_tensor_async(const at::Tensor& output, const at::Tensor& input,
                                               ReduceScatterOptions opts) const {
  HP_CHECK(output.defined(), "reduce_scatter_tensor: got an undefined output tensor");
  return reduce_scatter_impl(impl_, input, std::move(opts), Wait::kAsync, output);
}
at::Tensor ProcessGroup::reduce_scatter_tensor(const at::Tensor& output, const at::Tensor& input,
                                               ReduceScatterOptions opts) const {
  HP_CHECK(output.defined(), "reduce_scatter_tensor: got an undefined output tensor");
  return reduce_scatter_impl(impl_, input, std::move(opts), Wait::kBlocking, output).wait();
}

Work ProcessGroup::all_to_all_async(const at::Tensor& input, AllToAllOptions opts) const {
  impl();  // the empty-handle error
  return all_to_all_impl(impl_, input, std::move(opts), Wait::kAsync);
}

namespace {

// The copy of a sent tensor that a fake exchange holds until the peer takes it. A real send holds
// no such buffer, so it is made outside the memory trackers (a plain vector): were it charged to the
// sender until the receiving thread freed it, a dry run's peak would depend on when its peer ran.
at::Tensor exchange_copy(const at::Tensor& tensor) {
  const at::Tensor source = tensor.contiguous();
  auto bytes = std::make_shared<std::vector<uint8_t>>(source.nbytes());
  if (source.nbytes() > 0) std::memcpy(bytes->data(), source.data_ptr(), source.nbytes());
  return at::from_blob(
      bytes->data(), source.sizes(), [bytes](void*) {}, source.options());
}

}  // namespace

Work ProcessGroup::broadcast_async(const at::Tensor& tensor, int root) const {
  impl();  // the empty-handle error
  return broadcast_impl(impl_, tensor, root, Wait::kAsync);
}

Work ProcessGroup::send_async(const at::Tensor& tensor, int peer, int tag) const {
  const MemoryLabel communication(MemoryLabel::kCommunication);  // its buffers, for a dry run's report
  GroupImpl& g = impl();
  check_tensor("send", tensor, g);
  check_peer("send", g, peer);
  if (g.fake) {
    new_p2p_site(g, "send", tensor.nbytes(), peer, tag);
    if (g.exchange && !tensor.is_meta())
      g.exchange->state().post({g.ranks, g.ranks[g.rank], g.ranks[peer], tag}, exchange_copy(tensor));
    return ready(tensor);
  }
  at::Tensor buffer = tensor.contiguous();
  Step step;
  step.start = [&g, buffer, peer, tag] { return shim::send(*g.native, shim::to_wire(*g.native, buffer), peer, tag); };
  step.finish = [tensor] { return tensor; };
  return issue_native(impl_, new_p2p_site(g, "send", tensor.nbytes(), peer, tag), std::move(step));
}

Work ProcessGroup::recv_async(const at::Tensor& tensor, int peer, int tag) const {
  const MemoryLabel communication(MemoryLabel::kCommunication);  // its buffers, for a dry run's report
  GroupImpl& g = impl();
  check_tensor("recv", tensor, g);
  check_peer("recv", g, peer);
  if (g.fake) {  // without an exchange, the tensor keeps its values: nobody sent any
    new_p2p_site(g, "recv", tensor.nbytes(), peer, tag);
    if (g.exchange && !tensor.is_meta()) {
      const std::string what = "recv from group rank " + std::to_string(peer) + " (tag " + std::to_string(tag) +
                               ") on " + g.describe() + " of a fake world";
      const at::Tensor sent =
          g.exchange->state().take({g.ranks, g.ranks[peer], g.ranks[g.rank], tag}, g.options.timeout, what);
      HP_CHECK(sent.sizes() == tensor.sizes() && sent.scalar_type() == tensor.scalar_type(), what, ": the peer sent ",
               sent.scalar_type(), " ", sent.sizes(), " into ", tensor.scalar_type(), " ", tensor.sizes());
      tensor.copy_(sent);
    }
    return ready(tensor);
  }
  Step step = in_place_step(tensor, [&g, peer, tag](const at::Tensor& buffer) {
    return shim::recv(*g.native, shim::to_wire(*g.native, buffer), peer, tag);
  });
  return issue_native(impl_, new_p2p_site(g, "recv", tensor.nbytes(), peer, tag), std::move(step));
}

std::vector<Work> ProcessGroup::batch_isend_irecv(const std::vector<P2POp>& ops) const {
  const GroupImpl& g = impl();
  for (size_t i = 0; i < ops.size(); ++i) {
    const std::string op = "batch_isend_irecv: operation " + std::to_string(i) +
                           (ops[i].kind == P2POp::Kind::kSend ? " (send)" : " (recv)");
    check_tensor(op.c_str(), ops[i].tensor, g);
    check_peer(op.c_str(), g, ops[i].peer);
  }
  std::vector<Work> works;
  works.reserve(ops.size());
  for (const P2POp& op : ops)
    works.push_back(op.kind == P2POp::Kind::kSend ? send_async(op.tensor, op.peer, op.tag)
                                                  : recv_async(op.tensor, op.peer, op.tag));
  return works;
}

Work ProcessGroup::barrier_async() const {
  impl();  // the empty-handle error
  return barrier_impl(impl_, Wait::kAsync);
}

at::Tensor ProcessGroup::all_gather(const at::Tensor& t, AllGatherOptions o) const {
  return all_gather_impl(impl_, t, std::move(o), Wait::kBlocking).wait();
}
at::Tensor ProcessGroup::all_to_all(const at::Tensor& t, AllToAllOptions o) const {
  impl();  // the empty-handle error
  return all_to_all_impl(impl_, t, std::move(o), Wait::kBlocking).wait();
}
at::Tensor ProcessGroup::broadcast(const at::Tensor& t, int root) const {
  impl();  // the empty-handle error
  return broadcast_impl(impl_, t, root, Wait::kBlocking).wait();
}
void ProcessGroup::send(const at::Tensor& t, int peer, int tag) const { send_async(t, peer, tag).wait(); }
at::Tensor ProcessGroup::recv(const at::Tensor& t, int peer, int tag) const { return recv_async(t, peer, tag).wait(); }
void ProcessGroup::barrier() const {
  impl();  // the empty-handle error
  barrier_impl(impl_, Wait::kBlocking).wait();
}

}  // namespace hp::comm
