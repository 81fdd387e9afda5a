// fully_shard (hp/parallel/fsdp.h).
//
// Layout: every rank packs its shards of the unit's parameters into one flat buffer of L elements,
// parameter i at offset[i] with room for its widest torch.chunk piece, zero padded. One all_gather
// gives [n, L]; parameter i is the concatenation over ranks r of row r's piece (along its shard
// dim). The gather is recorded for autograd as one node whose backward packs the parameters'
// gradients into [n, L] and starts an asynchronous reduce-scatter; a callback at the end of the
// backward pass waits for it and adds each shard to the sharded parameter's .grad.
//
// Memory: with reshard_after_forward, the gathered parameters' storage is released after forward
// (autograd still holds the tensors, now empty) and refilled by a hook on the unit's output when
// backward reaches the unit; the backward of the gather releases it again. ZeRO-1/2 keep them.
#include "hp/parallel/fsdp.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "hp/comm/init.h"
#include "hp/comm/process_group.h"
#include "hp/comm/tree_reduce.h"
#include "hp/core/chunking.h"
#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"
#include "hp/core/memory_timeline.h"
#include "hp/core/recompute.h"
#include "hp/core/storage_tier.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"
#include "parallel/layout.h"

namespace hp {
namespace detail {

struct ManagedParam {
  nn::Module* owner;
  std::string name, fqn;
  at::Tensor sharded;                 // the DTensor users and optimizers see
  std::vector<int64_t> shape;         // what FSDP shards: the parameter, or its tensor-parallel piece
  int64_t dim = 0;                    // the dim FSDP splits (shard_placement_fn; default 0)
  std::vector<int64_t> rows;          // size along `dim` on each shard rank (torch.chunk)
  int64_t row_numel = 1, offset = 0;  // elements per index of `dim`; where the padded slot starts
  std::optional<DTensorSpec> tp;      // set when the parameter was a tensor-parallel DTensor
};

// The parameters one forward call gathered; backward refills and releases them.
struct Gathered {
  std::vector<at::Tensor> params;  // one per ManagedParam, plain, full shape
  bool released = false;
  // With reshard_after_forward_to: this rank's rows of the gathered [n, L] buffer, kept from
  // forward to backward, where its block gathers them back.
  at::Tensor block_rows;
};

struct FsdpUnit {
  std::string name;
  FullyShardOptions options;
  comm::ProcessGroup shard_group;
  std::optional<comm::ProcessGroup> replicate_group;
  std::optional<comm::ProcessGroup> post_forward_group;  // reshard_after_forward_to: this rank's block
  int n = 1, rank = 0;
  std::vector<ManagedParam> params;
  int64_t flat = 0;  // L
  // The parameters' dtype when they share one (fp64 parameters gather and compute in fp64), else fp32.
  at::ScalarType params_dtype = at::kFloat;
  bool sync = true;
  double scale = 1.0;
  // [n, L] gradients of backward passes run with sync off. Deterministic groups sum them in
  // tree_reduce's order over the micro-batches, the association the deterministic collective
  // continues across ranks (docs/fsdp.md); others keep one running sum.
  comm::TreeSum pending_tree;
  at::Tensor pending_sum;
  bool tree_order = false;
  // Prefetching: the units whose gather this unit issues early, and a gather issued for this unit.
  // Backward without a list set: the unit that ran before this one in forward.
  std::vector<std::weak_ptr<FsdpUnit>> forward_prefetch;
  std::optional<std::vector<std::weak_ptr<FsdpUnit>>> backward_prefetch;
  struct Prefetched {
    comm::Work work;
    int64_t version;  // the shards' version when issued: stale data is never used
  };
  std::optional<Prefetched> prefetched_forward, prefetched_backward;
  std::weak_ptr<Gathered> last_call;  // the latest forward's gathered parameters
  int64_t forward_index = -1;         // position in this thread's last forward order
  // Levels 1 and 2: the gathered parameters kept between steps, valid while the shards' versions
  // are unchanged; level 1 also keeps the whole reduced gradient.
  std::vector<at::Tensor> kept;
  int64_t kept_version = -1;
  at::Tensor whole_gradient;

  bool keeps_parameters() const { return options.level != ShardingLevel::kParameters; }

  // Changes whenever any shard is written (an optimizer step, a checkpoint load, init_parameters).
  int64_t shards_version() const {
    int64_t v = 0;
    for (const ManagedParam& p : params) v += p.sharded._version() + local_tensor(p.sharded)._version();
    return v;
  }

  void keep_for_later(at::Tensor grad) {
    if (tree_order)
      pending_tree.add(std::move(grad));
    else if (!pending_sum.defined())
      pending_sum = grad.clone();
    else
      pending_sum.add_(grad);
  }

  // `grad` plus everything kept for later.
  at::Tensor with_kept(at::Tensor grad) {
    if (tree_order) {
      if (pending_tree.empty()) return grad;
      pending_tree.add(std::move(grad));
      return pending_tree.take();
    }
    if (!pending_sum.defined()) return grad;
    return std::exchange(pending_sum, at::Tensor()).add_(grad);
  }

  // This rank's shards packed into [1, L].
  // The dtype parameters are gathered and computed in.
  at::ScalarType compute_dtype() const { return options.mixed_precision.param_dtype.value_or(params_dtype); }

  // Packed buffers: on the shards' device, in the compute dtype.
  at::TensorOptions buffer_options() const {
    return local_tensor(params.front().sharded).options().dtype(compute_dtype());
  }

  // With offload, shards found outside the tier (a load that gave them new storage) move back into
  // it first; all are settled once read.
  at::Tensor pack_shards() const {
    at::Tensor buffer = at::zeros({1, flat}, buffer_options());
    const std::vector<at::Tensor> shards = offloaded_shards();
    for (const ManagedParam& p : params) {
      const at::Tensor& local = local_tensor(p.sharded);
      buffer[0].narrow(0, p.offset, local.numel()).copy_(local.reshape({-1}));
    }
    settle_storage(shards);
    return buffer;
  }

  // This rank's pieces of the shards.
  std::vector<at::Tensor> shard_pieces() const {
    std::vector<at::Tensor> pieces;
    for (const ManagedParam& p : params) pieces.push_back(local_tensor(p.sharded));
    return pieces;
  }

  // The shards' pieces, moved into the offload tier and read in; none without offload.
  std::vector<at::Tensor> offloaded_shards() const {
    if (!options.offload) return {};
    std::vector<at::Tensor> shards = shard_pieces();
    for (const at::Tensor& shard : shards) move_storage_to(shard, options.offload->tier());
    prefetch_storage(shards);  // one read of each, rather than page by page
    return shards;
  }

  // Whether prefetch() issues a gather for this unit into `slot`: it has parameters, no gather in
  // the slot yet, and (backward) is not resharded to a block, which gathers its block's rows instead.
  bool takes_prefetch(std::optional<Prefetched> FsdpUnit::*slot) const {
    return !params.empty() && !(this->*slot) && !(slot == &FsdpUnit::prefetched_backward && post_forward_group);
  }

  // Starts reading from the offload tier the shards of the units of `units` that prefetch() will
  // pack into `slot` next: all of them in one go, rather than each when its gather is issued.
  static void read_ahead(const std::vector<std::weak_ptr<FsdpUnit>>& units, std::optional<Prefetched> FsdpUnit::*slot) {
    for (const auto& weak : units)
      if (auto u = weak.lock(); u && u->options.offload && u->takes_prefetch(slot)) prefetch_storage(u->shard_pieces());
  }

  // Parameter i's full value from the gathered [n, L] buffer (differentiable when `gathered` is).
  at::Tensor unpack(const at::Tensor& gathered, const ManagedParam& p) const {
    std::vector<at::Tensor> pieces;
    std::vector<int64_t> piece_shape = p.shape;
    for (int r = 0; r < n; ++r) {
      piece_shape[p.dim] = p.rows[r];
      pieces.push_back(gathered[r].narrow(0, p.offset, p.rows[r] * p.row_numel).view(piece_shape));
    }
    return at::cat(pieces, p.dim);
  }

  at::Tensor all_gather() const { return shard_group.all_gather(pack_shards()); }

  // Reshard to a block of k ranks: member j of a block keeps rows [j n/k, (j+1) n/k) of the [n, L]
  // buffer, so the block's gather concatenates them back in row order.
  at::Tensor block_rows(const at::Tensor& gathered) const {
    const int k = post_forward_group->size(), rows = n / k;
    return gathered.narrow(0, post_forward_group->rank() * rows, rows).clone();
  }
  at::Tensor gather_block_rows(const at::Tensor& rows) const { return post_forward_group->all_gather(rows); }

  // The gathered [n, L] buffer: from a prefetch issued earlier if there is one and the shards have
  // not changed since (e.g. by an optimizer step), else gathered now.
  at::Tensor take_gathered(std::optional<Prefetched>& prefetched) const {
    if (!prefetched) return all_gather();
    at::Tensor gathered = prefetched->work.wait();  // waited on either way: every rank issued it
    const bool fresh = prefetched->version == shards_version();
    prefetched.reset();
    return fresh ? gathered : all_gather();
  }

  // Issues the gathers of `units` now, asynchronously, so they overlap this unit's compute.
  static void prefetch(const std::vector<std::weak_ptr<FsdpUnit>>& units, std::optional<Prefetched> FsdpUnit::*slot) {
    for (const auto& weak : units)
      if (auto u = weak.lock(); u && u->takes_prefetch(slot))
        (*u).*slot = Prefetched{u->shard_group.all_gather_async(u->pack_shards()), u->shards_version()};
  }

  // Backward: the units whose gathers to issue early — the list set, else the unit that ran
  // before this one in forward — if they will need a gather (their parameters were released).
  std::vector<std::weak_ptr<FsdpUnit>> backward_prefetch_targets(
      const std::vector<std::weak_ptr<FsdpUnit>>& order) const {
    std::vector<std::weak_ptr<FsdpUnit>> targets;
    if (backward_prefetch)
      targets = *backward_prefetch;
    else if (forward_index > 0 && forward_index <= static_cast<int64_t>(order.size()))
      targets.push_back(order[forward_index - 1]);
    std::vector<std::weak_ptr<FsdpUnit>> needed;
    for (const auto& weak : targets)
      if (auto u = weak.lock())
        if (auto call = u->last_call.lock(); call && call->released) needed.push_back(u);
    return needed;
  }

  // The inverse of unpack for gradients: each parameter's full gradient into its slots of an [n, L]
  // buffer (zeros where a parameter got no gradient, and in the padding).
  at::Tensor pack_gradients(std::vector<at::Tensor> grads) const {
    const MemoryLabel communication(MemoryLabel::kCommunication);  // the reduction's buffers
    at::Tensor buffer;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!grads[i].defined()) continue;
      if (!buffer.defined()) buffer = at::zeros({n, flat}, grads[i].options());
      const ManagedParam& p = params[i];
      int64_t row = 0;
      for (int r = 0; r < n; ++r) {
        buffer[r]
            .narrow(0, p.offset, p.rows[r] * p.row_numel)
            .copy_(grads[i].narrow(p.dim, row, p.rows[r]).reshape({-1}));
        row += p.rows[r];
      }
      grads[i].reset();  // packed: free it now, not after the whole unit
    }
    return buffer.defined() ? buffer : at::zeros({n, flat}, buffer_options());
  }

  // What the module computes with: the gathered tensor, or for a tensor-parallel parameter the
  // gathered tensor-parallel piece as a DTensor on its tensor-parallel mesh (differentiable).
  static at::Tensor as_module_param(const ManagedParam& p, const at::Tensor& gathered_piece) {
    if (!p.tp) return gathered_piece;
    return DTensor::from_local(gathered_piece, p.tp->mesh(), p.tp->placements(), p.tp->shape());
  }

  // [n, L] gradient -> this rank's shard of each parameter's gradient (DTensors; undefined = none).
  // Starts reducing the unit's [n, L] gradient (asynchronously, so backward goes on computing the
  // next units meanwhile); nullopt while sync is off (the gradient is kept for later).
  std::optional<comm::Work> start_reduction(at::Tensor grad) {
    const auto& mp = options.mixed_precision;
    grad = grad.to(mp.reduce_dtype.value_or(mp.param_dtype.value_or(grad.scalar_type())));
    if (scale != 1.0) grad = grad * scale;
    if (!sync) {
      keep_for_later(grad);
      return std::nullopt;
    }
    grad = with_kept(grad).contiguous();
    if (options.level == ShardingLevel::kOptimizer)
      return shard_group.all_reduce_async(grad, {options.reduce_op, mp.reduce_wire});
    comm::ReduceScatterOptions rs;
    rs.op = options.reduce_op;
    rs.wire = mp.reduce_wire;
    return shard_group.reduce_scatter_async(grad, rs);
  }

  // Waits for a reduction started by start_reduction and adds each shard of it to the sharded
  // parameter's .grad (FSDP2 sets gradients itself rather than through autograd's accumulation).
  void finish_reduction(comm::Work& work) {
    const MemoryLabel communication(MemoryLabel::kCommunication);  // the reduction's buffers
    at::Tensor mine = work.wait();                                 // [1, L], or [n, L] for ZeRO-1
    if (options.level == ShardingLevel::kOptimizer) {
      whole_gradient = mine;  // ZeRO-1: every rank keeps the whole reduced gradient
      mine = whole_gradient.narrow(0, rank, 1);
    }
    if (replicate_group)
      mine = replicate_group->all_reduce(mine, {options.reduce_op, options.mixed_precision.reduce_wire});
    at::NoGradGuard no_grad;
    for (const ManagedParam& p : params) {
      if (!p.sharded.requires_grad()) continue;
      const at::Tensor& local = local_tensor(p.sharded);
      const at::Tensor reduced = mine[0].narrow(0, p.offset, local.numel()).view(local.sizes());
      at::Tensor& slot = p.sharded.mutable_grad();
      if (slot.defined()) {
        prefetch_storage({local_tensor(slot)});  // offload: in one read, not page by page
        local_tensor(slot).add_(reduced.to(local.scalar_type()));
      } else {
        // With offload, made in the tier, as the shard it belongs to.
        at::Tensor g = options.offload ? empty_in_tier(options.offload->tier(), local.sizes(), local.options())
                                       : at::empty(local.sizes(), local.options());
        slot = from_local_unchecked(g.copy_(reduced), DTensor(p.sharded).spec());
      }
      if (options.offload) settle_storage({local_tensor(slot)});
    }
  }

  void set_params(const std::vector<at::Tensor>& gathered_pieces) {
    for (size_t i = 0; i < params.size(); ++i)
      params[i].owner->set_param(params[i].name, as_module_param(params[i], gathered_pieces[i]));
  }
  void put_shards_back() {
    for (const ManagedParam& p : params) p.owner->set_param(p.name, p.sharded);
  }
};

namespace {

// Releases / refills the storage of a gathered parameter while autograd keeps the tensor itself.
void release(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

// A new tensor on the same storage (each forward's outputs must be fresh for autograd).
at::Tensor alias_of(const at::Tensor& t) {
  at::Tensor alias = at::empty({0}, t.options());
  alias.set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
  return alias;
}

void refill(const at::Tensor& t, const at::Tensor& values) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = values.numel() * values.element_size();
  c10::OptionalDeviceGuard on_its_device(t.device());  // a GPU allocator allocates on the current device
  s->set_data_ptr_noswap(c10::GetAllocator(t.device().type())->allocate(nbytes));
  s->set_nbytes(nbytes);
  at::NoGradGuard no_grad;
  alias_of(t).copy_(values);  // through an alias: t's version (checked by autograd) stays
}

// Which modules are units (for "fully_shard twice" and for outer units skipping inner ones).
std::mutex registry_mu;
std::map<const nn::Module*, std::weak_ptr<FsdpUnit>>& registry() {
  static auto* r = new std::map<const nn::Module*, std::weak_ptr<FsdpUnit>>();
  return *r;
}

// The unit `m` itself is, or null.
std::shared_ptr<FsdpUnit> unit_of(const nn::Module& m) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry().find(&m);
  return it != registry().end() ? it->second.lock() : nullptr;
}

bool is_unit(const nn::Module* m) { return unit_of(*m) != nullptr; }

}  // namespace

// The (tp, dp...) mesh: entry [t][d...] is the rank with tensor-parallel index t in the data-parallel
// mesh's member d (found by gathering every member's tensor-parallel ranks). With a 2-D (replicate,
// shard) data-parallel mesh (HSDP) it is 3-D. Collective over dp.
DeviceMesh tp_dp_mesh(const DeviceMesh& tp, const DeviceMesh& dp) {
  const std::vector<int64_t> mine(tp.ranks().begin(), tp.ranks().end());
  const DeviceMesh flat = dp.ndim() == 1 ? dp : dp.flatten();  // members in row-major order
  const comm::ProcessGroup& members = flat.get_group(0);
  std::vector<int64_t> shape = dp.shape();
  shape.push_back(tp.size());
  std::vector<int64_t> order = {dp.ndim()};  // tp first, then the data-parallel dims
  for (int64_t d = 0; d < dp.ndim(); ++d) order.push_back(d);
  at::Tensor gathered;
  if (comm::is_fake(members)) {
    // A dry run has no peers to ask. Its meshes are build_mesh's grids, where a rank is an affine
    // function of its coordinate: member d's tensor-parallel ranks are this rank's, shifted by d - us.
    std::vector<int64_t> rows;
    for (int member : members.ranks())
      for (int64_t r : mine) rows.push_back(r + member - tp.get_rank());
    gathered = at::tensor(rows, at::kLong);
  } else {
    gathered = members.all_gather(at::tensor(mine, at::kLong).view({1, -1}));
  }
  const at::Tensor all = gathered.view(shape).permute(order);
  std::vector<std::string> names = {tp.dim_names()[0]};
  names.insert(names.end(), dp.dim_names().begin(), dp.dim_names().end());
  return DeviceMesh(dp.world(), dp.device_type(), all.contiguous(), names);
}

namespace {

// The reductions started during the current backward pass, finished in order: when a newer one
// starts (so one reduction overlaps the next unit's backward, as in FSDP2, and the gradient
// buffers in flight stay bounded however slowly the network goes), and the rest by one callback
// that the autograd engine runs when the pass ends (before anyone can read a gradient). Only the
// queued callback owns the list: when a pass fails, the engine drops its callbacks, the list
// expires, and the next pass starts a fresh one instead of appending to a list nobody finishes.
struct PendingReductions {
  std::vector<std::pair<std::shared_ptr<FsdpUnit>, comm::Work>> items;
  size_t finished = 0;
  void finish_up_to(size_t end) {
    for (; finished < end; ++finished) {
      items[finished].first->finish_reduction(items[finished].second);
      items[finished] = {};  // drops the gradient buffer the work held
    }
  }
};
constexpr size_t kReductionsInFlight = 1;
thread_local std::weak_ptr<PendingReductions> this_backward;

void finish_at_end_of_backward(std::shared_ptr<FsdpUnit> unit, comm::Work work) {
  std::shared_ptr<PendingReductions> pending = this_backward.lock();
  if (!pending) {
    pending = std::make_shared<PendingReductions>();
    this_backward = pending;
    torch::autograd::Engine::get_default_engine().queue_callback([pending] {
      this_backward.reset();  // this pass is done: the next one starts its own list
      pending->finish_up_to(pending->items.size());
      pending->items.clear();
    });
  }
  if (pending->items.size() - pending->finished >= kReductionsInFlight)
    pending->finish_up_to(pending->items.size() + 1 - kReductionsInFlight);
  pending->items.emplace_back(std::move(unit), std::move(work));
}

bool ignored(const FullyShardOptions& options, const std::string& fqn) {
  return std::any_of(options.ignored_params.begin(), options.ignored_params.end(),
                     [&](const std::string& pattern) { return nn::fqn_matches(pattern, fqn); });
}

// This thread's forward order of units (reset when an outermost unit starts), for implicit
// backward prefetch.
thread_local std::vector<std::weak_ptr<FsdpUnit>> forward_order;
thread_local int unit_depth = 0;

// Forward pre-hook: gather, recording the reduce-scatter as the gather's backward.
std::shared_ptr<Gathered> gather_for_forward(const std::shared_ptr<FsdpUnit>& unit) {
  // The gathered parameters are communication buffers in a dry run's report, not the block's activations.
  const MemoryLabel communication(MemoryLabel::kCommunication);
  auto call = std::make_shared<Gathered>();
  std::vector<at::Tensor> full;
  {
    at::NoGradGuard no_grad;  // recorded below as one node: gather forward, reduce-scatter backward
    if (unit->keeps_parameters() && unit->kept_version == unit->shards_version()) {
      for (const at::Tensor& k : unit->kept) full.push_back(alias_of(k));  // no communication
    } else {
      if (!recomputing()) FsdpUnit::read_ahead(unit->forward_prefetch, &FsdpUnit::prefetched_forward);
      const at::Tensor gathered = unit->take_gathered(unit->prefetched_forward);
      // Not from a recomputation in backward: the next forward would take stale parameters.
      if (!recomputing()) FsdpUnit::prefetch(unit->forward_prefetch, &FsdpUnit::prefetched_forward);
      for (const ManagedParam& p : unit->params) full.push_back(unit->unpack(gathered, p));
      if (unit->post_forward_group) call->block_rows = unit->block_rows(gathered);
      if (unit->keeps_parameters()) {
        unit->kept = full;
        for (at::Tensor& f : full) f = alias_of(f);
        unit->kept_version = unit->shards_version();
      }
    }
  }  // the [n, L] buffer is freed here
  std::vector<at::Tensor> inputs;
  for (const ManagedParam& p : unit->params) inputs.push_back(p.sharded);
  const bool reshard = unit->options.reshard_after_forward && !unit->keeps_parameters();
  std::weak_ptr<FsdpUnit> weak = unit;
  std::weak_ptr<Gathered> weak_call = call;
  call->params = record_backward("fsdp_all_gather(" + unit->name + ")", inputs, std::move(full),
                                 [weak, weak_call, reshard](std::vector<at::Tensor> grads) {
                                   auto u = weak.lock();
                                   HP_CHECK(u != nullptr, "fully_shard: the unit was destroyed before its backward");
                                   if (auto c = weak_call.lock(); c && reshard) {
                                     for (const at::Tensor& t : c->params) release(t);  // backward is done with them
                                     c->released = true;
                                   }
                                   if (auto work = u->start_reduction(u->pack_gradients(std::move(grads))))
                                     finish_at_end_of_backward(u, std::move(*work));
                                   return std::vector<at::Tensor>(u->params.size());  // set by finish_reduction
                                 });
  return call;
}

}  // namespace
}  // namespace detail

using detail::FsdpUnit;
using detail::Gathered;
using detail::ManagedParam;

FSDPModule fully_shard(nn::Module& module, const DeviceMesh& mesh, FullyShardOptions options) {
  HP_CHECK(!detail::is_unit(&module), "fully_shard: ", module.name(), " is already a fully_shard unit");
  HP_CHECK(mesh.ndim() == 1 || mesh.ndim() == 2,
           "fully_shard: the mesh must be 1-D (FSDP) or 2-D (replicate, shard) "
           "for HSDP, got ",
           mesh.str());
  HP_CHECK(mesh.get_coordinate().has_value(), "fully_shard: this rank (", mesh.get_rank(), ") is not in ", mesh.str());
  HP_CHECK(!options.offload || mesh.device_type() == "cpu", "fully_shard: parameter offload keeps CPU tensors; ",
           "the mesh is on ", mesh.device_type(), " (offload from an accelerator is not built yet)");
  HP_CHECK(!options.offload || options.level == ShardingLevel::kParameters,
           "fully_shard: parameter offload needs ZeRO-3 (level kParameters): ZeRO-1/2 keep the gathered parameters ",
           "(and ZeRO-1 the whole gradient) in the compute allocator between steps, more than offload takes out");
  auto unit = std::make_shared<FsdpUnit>();
  unit->name = module.name();
  unit->options = options;
  const int64_t shard_dim = mesh.ndim() - 1;
  unit->shard_group = mesh.get_group(shard_dim);
  if (mesh.ndim() == 2) unit->replicate_group = mesh.get_group(0);
  unit->n = unit->shard_group.size();
  unit->rank = unit->shard_group.rank();
  if (const int k = options.reshard_after_forward_to; k != 0) {
    HP_CHECK(k > 0 && unit->n % k == 0, "fully_shard: reshard_after_forward_to (", k,
             ") must divide the shard group's size (", unit->n, ")");
    HP_CHECK(options.reshard_after_forward && options.level == ShardingLevel::kParameters,
             "fully_shard: reshard_after_forward_to needs reshard_after_forward and ZeRO-3 (level kParameters)");
    if (k < unit->n) {  // k == n is plain resharding
      const int first = unit->rank / k * k;
      std::vector<int> block;
      for (int r = first; r < first + k; ++r) block.push_back(unit->shard_group.ranks()[r]);
      unit->post_forward_group = unit->shard_group.new_group(block, "fsdp_post_forward");
    }
  }
  unit->tree_order = unit->shard_group.options().deterministic;

  // The parameters of this module and of submodules that are not units themselves.
  std::vector<std::pair<std::string, nn::Module*>> owned;
  std::vector<std::string> skipped;
  for (auto& [fqn, m] : module.named_modules_fqn()) {
    bool inside_unit = false;
    for (const std::string& s : skipped) inside_unit = inside_unit || fqn.rfind(s + ".", 0) == 0 || fqn == s;
    if (inside_unit) continue;
    if (!fqn.empty() && detail::is_unit(m)) {
      skipped.push_back(fqn);
      continue;
    }
    owned.emplace_back(fqn, m);
  }
  // Tensor-parallel parameters (DTensors on a 1-D mesh): FSDP shards their local piece's dim 0 over
  // the data-parallel ranks; their sharded form lives on the (tp, dp) mesh.
  std::optional<DeviceMesh> tp_mesh;
  for (auto& [prefix, m] : owned) {
    for (const auto& item : m->named_parameters(/*recurse=*/false)) {
      const at::Tensor& p = item.value();
      const std::string fqn = prefix.empty() ? item.key() : prefix + "." + item.key();
      std::optional<DTensorSpec> tp;
      at::Tensor piece = p;
      if (is_dtensor(p)) {
        tp = DTensor(p).spec();
        HP_CHECK(mesh.ndim() <= 2 && tp->mesh().ndim() == 1, "fully_shard: ", fqn, " is a DTensor on ",
                 tp->mesh().str(),
                 "; FSDP composes with tensor parallelism on a 1-D (FSDP) or 2-D (HSDP) data-parallel mesh and a "
                 "1-D tensor-parallel mesh");
        for (const Placement& pl : tp->placements())
          HP_CHECK(!pl.is_partial(), "fully_shard: ", fqn, " is ", to_string(tp->placements()),
                   "; cannot shard a Partial parameter");
        HP_CHECK(!tp_mesh || *tp_mesh == tp->mesh(),
                 "fully_shard: the parameters of one unit must share one "
                 "tensor-parallel mesh; ",
                 fqn, " is on ", tp->mesh().str(), ", others on ", tp_mesh->str());
        tp_mesh = tp->mesh();
        piece = local_tensor(p);
      }
      if (detail::ignored(options, fqn)) continue;
      HP_CHECK(piece.dim() >= 1, "fully_shard: ", fqn,
               " is a scalar; FSDP shards a dim of it (list it in ignored_params)");
      int64_t dim = 0;
      if (options.shard_placement_fn)
        if (const auto chosen = options.shard_placement_fn(fqn, p))
          dim = parallel::normalized(*chosen, piece.dim()).dim();
      HP_CHECK(dim >= 0 && dim < piece.dim(), "fully_shard: ", fqn, " has ", piece.dim(),
               " dims; shard_placement_fn chose dim ", dim);
      HP_CHECK(piece.size(dim) >= unit->n, "fully_shard: ", fqn, " has ", piece.size(dim), " rows in dim ", dim,
               tp ? " (of its tensor-parallel piece)" : "", ", fewer than the ", unit->n,
               " ranks it would be split over; leave it to an outer unit on fewer ranks or replicate it");
      ManagedParam mp{m, item.key(), fqn, {}, piece.sizes().vec(), dim, chunk_sizes(piece.size(dim), unit->n)};
      mp.row_numel = piece.numel() / std::max<int64_t>(piece.size(dim), 1);
      mp.offset = unit->flat;
      mp.tp = tp;
      unit->flat += mp.rows[0] * mp.row_numel;  // rows[0] is the widest piece
      unit->params_dtype =
          unit->params.empty() || unit->params_dtype == piece.scalar_type() ? piece.scalar_type() : at::kFloat;
      unit->params.push_back(std::move(mp));
    }
  }
  const std::optional<DeviceMesh> combined =
      tp_mesh ? std::optional<DeviceMesh>(detail::tp_dp_mesh(*tp_mesh, mesh)) : std::nullopt;
  for (ManagedParam& mp : unit->params) {
    if (!combined) {
      Placements placements(mesh.ndim(), Replicate());
      placements.back() = Shard(mp.dim);
      parallel::distribute_parameter(*mp.owner, mp.name, mesh, placements, mp.fqn);
    } else {
      const at::Tensor p = mp.owner->param(mp.name);
      const Placement tp_placement = mp.tp ? mp.tp->placements()[0] : Replicate();
      Placements placements(combined->ndim(), Replicate());  // replicated over HSDP's replicate dim
      placements.front() = tp_placement;
      placements.back() = Shard(mp.dim);
      const DTensorSpec spec(*combined, placements, p.sizes().vec());
      const at::Tensor piece = mp.tp ? local_tensor(p) : p;
      at::Tensor local = piece.is_meta() ? at::empty(spec.local_shape(), piece.options())
                                         : piece.detach()
                                               .narrow(mp.dim, chunk_offset(piece.size(mp.dim), unit->n, unit->rank),
                                                       mp.rows[unit->rank])
                                               .clone();
      parallel::set_placed_parameter(*mp.owner, mp.name, from_local_unchecked(local, spec));
    }
    mp.sharded = mp.owner->param(mp.name);
    // Into the tier now: a shard without storage yet (deferred initialization) gets it there, and
    // optimizer state made before the first forward follows it.
    if (options.offload) move_storage_to(local_tensor(mp.sharded), options.offload->tier());
  }
  {
    std::lock_guard<std::mutex> lock(detail::registry_mu);
    detail::registry()[&module] = unit;
  }
  if (unit->params.empty()) {
    module.register_forward_pre_hook([unit](nn::Module&, nn::Inputs&) {});  // keeps the unit alive
    return FSDPModule(unit);
  }

  // Per forward call: the gathered parameters of that call, for the post-hook and backward.
  auto current = std::make_shared<std::shared_ptr<Gathered>>();
  std::weak_ptr<FsdpUnit> weak = unit;
  // The module's hooks own the unit: it lives exactly as long as the module.
  module.register_forward_pre_hook([unit, current](nn::Module&, nn::Inputs& inputs) {
    // A recomputation (activation checkpointing) runs in backward: the forward order stays the
    // forward's, for backward prefetching.
    const bool forward = !recomputing();
    if (detail::unit_depth++ == 0 && forward) detail::forward_order.clear();
    if (forward) {
      unit->forward_index = static_cast<int64_t>(detail::forward_order.size());
      detail::forward_order.push_back(unit);
    }
    if (const auto dtype = unit->options.mixed_precision.param_dtype)  // compute in one dtype throughout
      for (at::Tensor& x : inputs)
        if (x.defined() && x.is_floating_point()) x = x.to(*dtype);
    {
      const NotRegionComputation machinery;  // differs in a recomputation (no prefetch)
      *current = detail::gather_for_forward(unit);
    }
    unit->last_call = *current;
    unit->set_params((*current)->params);
  });
  module.register_forward_hook([weak, current](nn::Module&, const nn::Inputs&, at::Tensor& output) {
    auto u = weak.lock();
    std::shared_ptr<Gathered> call = std::move(*current);
    detail::unit_depth = std::max(0, detail::unit_depth - 1);
    u->put_shards_back();
    if (const auto dtype = u->options.mixed_precision.output_dtype; dtype && output.is_floating_point())
      output = output.to(*dtype);
    // A recomputation's backward follows (its weight pass later, under a split backward): the
    // parameters stay gathered for it.
    if (!u->options.reshard_after_forward || u->keeps_parameters() || !output.requires_grad() || recomputing()) return;
    const NotRegionComputation machinery;  // not in a recomputation
    for (const at::Tensor& t : call->params) detail::release(t);
    call->released = true;
    // Backward reaches this unit once its output's gradient is complete: gather again first.
    output.register_hook([weak, call](const at::Tensor& grad) {
      auto unit = weak.lock();
      if (unit && call->released) {
        const MemoryLabel communication(MemoryLabel::kCommunication);  // gathered again for backward
        const auto targets = unit->backward_prefetch_targets(detail::forward_order);
        FsdpUnit::read_ahead(targets, &FsdpUnit::prefetched_backward);
        at::Tensor gathered;
        if (call->block_rows.defined()) {
          gathered = unit->gather_block_rows(call->block_rows);
          call->block_rows = at::Tensor();
        } else {
          gathered = unit->take_gathered(unit->prefetched_backward);
        }
        FsdpUnit::prefetch(targets, &FsdpUnit::prefetched_backward);
        for (size_t i = 0; i < call->params.size(); ++i)
          detail::refill(call->params[i], unit->unpack(gathered, unit->params[i]));
        call->released = false;
      }
      return grad;
    });
  });
  return FSDPModule(unit);
}

void FSDPModule::unshard() {
  at::NoGradGuard no_grad;
  const at::Tensor gathered = unit_->all_gather();
  std::vector<at::Tensor> full;
  for (const ManagedParam& p : unit_->params) full.push_back(unit_->unpack(gathered, p));
  unit_->set_params(full);
}

std::vector<std::pair<std::string, FSDPModule>> named_fsdp_units(nn::Module& root) {
  std::vector<std::pair<std::string, FSDPModule>> units;
  std::lock_guard<std::mutex> lock(detail::registry_mu);
  for (const auto& [fqn, m] : root.named_modules_fqn())
    if (auto it = detail::registry().find(m); it != detail::registry().end())
      if (auto unit = it->second.lock()) units.emplace_back(fqn, FSDPModule(std::move(unit)));
  return units;
}

std::vector<FSDPModule> fsdp_units(nn::Module& root) {
  std::vector<FSDPModule> units;
  for (auto& [fqn, unit] : named_fsdp_units(root)) units.push_back(std::move(unit));
  return units;
}

void set_prefetch_depth(nn::Module& root, const std::vector<nn::Module*>& chain, int depth) {
  HP_CHECK(depth >= 0, "set_prefetch_depth: depth ", depth, " must be >= 0");
  // Each link's units: its own first, then those below it.
  std::vector<std::vector<FSDPModule>> links;
  for (nn::Module* m : chain) links.push_back(fsdp_units(*m));
  const auto n = static_cast<int64_t>(links.size());
  // The units of up to `depth` links from `first` on, stepping by `step` (+1 forward, -1 backward),
  // in the order they will run, so that each gather is issued ahead of those needed later: a link's
  // own unit first (its hooks run around the inner ones), then its inner units in forward order, or
  // in backward the reverse.
  auto units_from = [&](int64_t first, int64_t step) {
    std::vector<FSDPModule> units;
    for (int64_t i = first, k = 0; k < depth && i >= 0 && i < n; i += step, ++k) {
      const auto& link = links[i];
      if (step > 0) {
        units.insert(units.end(), link.begin(), link.end());
      } else if (!link.empty()) {
        units.push_back(link.front());
        units.insert(units.end(), link.rbegin(), link.rend() - 1);
      }
    }
    return units;
  };
  // No unit prefetches but those given lists below: a link's inner units gather with their link.
  for (FSDPModule& unit : fsdp_units(root)) {
    unit.set_modules_to_forward_prefetch({});
    unit.set_modules_to_backward_prefetch({});
  }
  if (depth == 0) return;
  for (int64_t i = 0; i < n; ++i) {
    const auto own = detail::unit_of(*chain[i]);
    if (!own) continue;  // not a unit itself: no hook of its own to issue them from
    FSDPModule link(own);
    link.set_modules_to_forward_prefetch(units_from(i + 1, +1));
    link.set_modules_to_backward_prefetch(units_from(i - 1, -1));
  }
  if (auto own = detail::unit_of(root)) {
    // The root runs first both ways: its forward starts before the first link's, its backward
    // (that of its output) before the last link's.
    FSDPModule root_unit(own);
    root_unit.set_modules_to_forward_prefetch(units_from(0, +1));
    root_unit.set_modules_to_backward_prefetch(units_from(n - 1, -1));
  }
}

void FSDPModule::reshard() { unit_->put_shards_back(); }
void FSDPModule::set_requires_gradient_sync(bool sync) { unit_->sync = sync; }
void FSDPModule::set_reduce_op(comm::ReduceOp op) {
  HP_CHECK(op == comm::ReduceOp::kSum || op == comm::ReduceOp::kAvg,
           "set_reduce_op: gradients reduce by sum or avg, got ", comm::to_string(op));
  unit_->options.reduce_op = op;
}
void FSDPModule::set_gradient_scaling_factor(double factor) { unit_->scale = factor; }

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  unit_->forward_prefetch.clear();
  for (const FSDPModule& m : modules) unit_->forward_prefetch.push_back(m.unit_);
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  unit_->backward_prefetch.emplace();
  for (const FSDPModule& m : modules) unit_->backward_prefetch->push_back(m.unit_);
}

}  // namespace hp
