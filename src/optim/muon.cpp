#include "hp/optim/muon.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "hp/core/chunking.h"
#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"
#include "hp/dtensor/local.h"
#include "optim/builtin_kinds.h"
#include "optim/closure.h"
#include "optim/state_in_tier.h"

namespace hp {

at::Tensor newton_schulz5(const at::Tensor& g, int64_t steps) {
  HP_CHECK(g.dim() == 2, "newton_schulz5: needs a matrix, got shape ", g.sizes());
  constexpr double a = 3.4445, b = -4.7750, c = 2.0315;
  const bool tall = g.size(0) > g.size(1);
  at::Tensor x = tall ? g.t() : g;
  x = x / (x.norm() + 1e-7);
  for (int64_t i = 0; i < steps; ++i) {
    const at::Tensor m = at::mm(x, x.t());
    const at::Tensor poly = b * m + c * at::mm(m, m);
    x = a * x + at::mm(poly, x);
  }
  return tall ? x.t().contiguous() : x.contiguous();
}

namespace {

double shape_scale(const at::Tensor& p) {
  return std::sqrt(std::max(1.0, static_cast<double>(p.size(0)) / static_cast<double>(p.size(1))));
}

// An update waiting to be orthogonalized: the parameter (for its shape and layout) and this rank's
// piece of the update.
struct Pending {
  at::Tensor param;
  at::Tensor local_update;
  at::Tensor result;  // this rank's piece of the orthogonalized, scaled update
};

// Owners for matrices of sizes `numel` over `ranks` ranks: largest first, to the least loaded rank
// (ties: lowest rank). Deterministic, the same on every rank.
std::vector<int> balance_owners(const std::vector<int64_t>& numel, int ranks) {
  std::vector<size_t> order(numel.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t i, size_t j) { return numel[i] > numel[j]; });
  std::vector<int64_t> load(ranks, 0);
  std::vector<int> owner(numel.size());
  for (size_t i : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = r;
    load[r] += numel[i];
  }
  return owner;
}

// Orthogonalizes the updates of parameters sharded on dim `dim` of one 1-D mesh: pieces go to each
// matrix's owner (all_to_all), owners orthogonalize, pieces come back (all_to_all).
void orthogonalize_on_owners(std::vector<Pending*>& items, const DeviceMesh& mesh, int64_t steps) {
  const comm::ProcessGroup& group = mesh.get_group(0);
  const int n = group.size(), me = group.rank();
  std::vector<int64_t> sizes;
  for (Pending* p : items) sizes.push_back(p->param.numel());
  const std::vector<int> owner = balance_owners(sizes, n);
  auto piece_numel = [&](const Pending& p, int r) {
    const int64_t d = DTensor(p.param).placements()[0].dim();
    return chunk_sizes(p.param.size(d), n)[r] * (p.param.numel() / std::max<int64_t>(p.param.size(d), 1));
  };
  // Send: my piece of matrix i goes to owner[i]; ordered by destination rank, then matrix.
  std::vector<at::Tensor> out;
  std::vector<int64_t> send(n, 0), recv(n, 0);
  for (int dest = 0; dest < n; ++dest)
    for (size_t i = 0; i < items.size(); ++i)
      if (owner[i] == dest) {
        out.push_back(items[i]->local_update.to(at::kFloat).reshape({-1}));
        send[dest] += items[i]->local_update.numel();
      }
  for (int src = 0; src < n; ++src)
    for (size_t i = 0; i < items.size(); ++i)
      if (owner[i] == me) recv[src] += piece_numel(*items[i], src);
  comm::AllToAllOptions to_owner;
  to_owner.input_split_sizes = send;
  to_owner.output_split_sizes = recv;
  const at::Tensor received = group.all_to_all(out.empty() ? at::zeros({0}) : at::cat(out), to_owner);
  // Owner: reassemble, orthogonalize, cut into pieces again (same order as received).
  std::map<size_t, at::Tensor> pieces_back;  // matrix -> flat pieces for ranks 0..n-1 concatenated
  std::vector<int64_t> offset_by_src(n, 0);
  for (int src = 1; src < n; ++src) offset_by_src[src] = offset_by_src[src - 1] + recv[src - 1];
  for (size_t i = 0; i < items.size(); ++i) {
    if (owner[i] != me) continue;
    const at::Tensor& param = items[i]->param;
    const int64_t d = DTensor(param).placements()[0].dim();
    std::vector<at::Tensor> parts;
    for (int src = 0; src < n; ++src) {
      std::vector<int64_t> shape = param.sizes().vec();
      shape[d] = chunk_sizes(param.size(d), n)[src];
      parts.push_back(received.narrow(0, offset_by_src[src], piece_numel(*items[i], src)).view(shape));
      offset_by_src[src] += piece_numel(*items[i], src);
    }
    const at::Tensor full = newton_schulz5(at::cat(parts, d), steps) * shape_scale(param);
    std::vector<at::Tensor> flat;
    for (int r = 0; r < n; ++r)
      flat.push_back(full.narrow(d, chunk_offset(param.size(d), n, r), chunk_sizes(param.size(d), n)[r]).reshape({-1}));
    pieces_back[i] = at::cat(flat);
  }
  // Return trip: the owner sends piece r of each matrix it owns to rank r.
  std::vector<at::Tensor> back;
  std::vector<int64_t> send_back(n, 0), recv_back(n, 0);
  for (int dest = 0; dest < n; ++dest)
    for (size_t i = 0; i < items.size(); ++i)
      if (owner[i] == me) {
        int64_t start = 0;
        for (int r = 0; r < dest; ++r) start += piece_numel(*items[i], r);
        back.push_back(pieces_back[i].narrow(0, start, piece_numel(*items[i], dest)));
        send_back[dest] += piece_numel(*items[i], dest);
      }
  for (int src = 0; src < n; ++src)
    for (size_t i = 0; i < items.size(); ++i)
      if (owner[i] == src) recv_back[src] += items[i]->local_update.numel();
  comm::AllToAllOptions from_owner;
  from_owner.input_split_sizes = send_back;
  from_owner.output_split_sizes = recv_back;
  const at::Tensor mine = group.all_to_all(back.empty() ? at::zeros({0}) : at::cat(back), from_owner);
  std::vector<int64_t> cursor(n, 0);
  for (int src = 1; src < n; ++src) cursor[src] = cursor[src - 1] + recv_back[src - 1];
  for (size_t i = 0; i < items.size(); ++i) {
    const at::Tensor& local = items[i]->local_update;
    items[i]->result = mine.narrow(0, cursor[owner[i]], local.numel()).view(local.sizes()).to(local.scalar_type());
    cursor[owner[i]] += local.numel();
  }
}

bool owner_scheme_applies(const at::Tensor& param) {
  if (!is_dtensor(param)) return false;
  const DTensor d(param);
  return d.device_mesh().ndim() == 1 && d.placements()[0].is_shard();
}

// Muon's momentum buffer starts at zero.
void init_muon_state(const at::Tensor& p, std::unique_ptr<torch::optim::OptimizerParamState>& slot) {
  auto s = std::make_unique<MuonParamState>();
  s->momentum_buffer(detail::zero_state_like(p));
  slot = std::move(s);
}

void validate_muon_group(const torch::optim::OptimizerParamGroup& group) {
  const auto& o = static_cast<const MuonOptions&>(group.options());
  HP_CHECK(o.lr() >= 0 && o.momentum() >= 0 && o.momentum() < 1 && o.ns_steps() > 0,
           "Muon: need lr >= 0, momentum in [0, 1) and ns_steps > 0");
  for (const at::Tensor& p : group.params())
    HP_CHECK(p.dim() == 2, "Muon: orthogonalizes matrices only; a parameter has shape ", p.sizes(),
             " (give embeddings, norms, biases and the head to AdamW, e.g. through ChainedOptimizer)");
}

void muon_step_group(torch::optim::OptimizerParamGroup& group, OptimizerStateMap& state) {
  const auto& o = static_cast<const MuonOptions&>(group.options());
  std::vector<Pending> pending;
  std::vector<at::Tensor> touched;  // read ahead from an offload tier, settled after the update
  for (const at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    auto& slot = state[optimizer_state_key(p)];
    if (!slot) init_muon_state(p, slot);
    at::Tensor& buffer = static_cast<MuonParamState&>(*slot).momentum_buffer();
    for (const at::Tensor& t : {p, p.grad(), buffer}) touched.push_back(local_tensor(t));
  }
  prefetch_storage(touched);
  for (const at::Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    at::Tensor& buffer = static_cast<MuonParamState&>(*state[optimizer_state_key(p)]).momentum_buffer();
    buffer.lerp_(p.grad(), 1.0 - o.momentum());
    const at::Tensor update = o.nesterov() ? p.grad().lerp(buffer, o.momentum()) : buffer;
    pending.push_back({p, local_tensor(update), at::Tensor()});
  }
  // Orthogonalize: plain and replicated updates here; sharded ones by mesh, on their owners.
  std::map<std::string, std::vector<Pending*>> by_mesh;
  for (Pending& item : pending) {
    if (owner_scheme_applies(item.param)) {
      by_mesh[DTensor(item.param).device_mesh().str()].push_back(&item);
    } else if (is_dtensor(item.param)) {
      const DTensor d(item.param);
      const at::Tensor full = DTensor(from_local_unchecked(item.local_update, d.spec())).full_tensor();
      const at::Tensor o_full = newton_schulz5(full.to(at::kFloat), o.ns_steps()) * shape_scale(item.param);
      item.result = DTensor(distribute_tensor(o_full, d.device_mesh(), d.placements())).to_local();
    } else {
      item.result = newton_schulz5(item.local_update.to(at::kFloat), o.ns_steps()) * shape_scale(item.param);
    }
  }
  for (auto& [mesh, items] : by_mesh)
    orthogonalize_on_owners(items, DTensor(items[0]->param).device_mesh(), o.ns_steps());
  for (Pending& item : pending) {
    const at::Tensor& local = local_tensor(item.param);
    if (o.weight_decay() != 0.0) local.mul_(1.0 - o.lr() * o.weight_decay());
    local.add_(item.result.to(local.scalar_type()), -o.lr());
  }
  settle_storage(touched);
}

class MuonKind : public OptimizerKind {
 public:
  std::string name() const override { return "Muon"; }
  void init_state(const torch::optim::OptimizerOptions& /*options*/, const at::Tensor& p,
                  std::unique_ptr<torch::optim::OptimizerParamState>& slot) const override {
    init_muon_state(p, slot);
  }
  ParamStateFields fields(torch::optim::OptimizerParamState& state) const override {
    return {{{"momentum_buffer", static_cast<MuonParamState&>(state).momentum_buffer()}}, std::nullopt};
  }
  void validate(const torch::optim::OptimizerParamGroup& group) const override { validate_muon_group(group); }
  bool can_step_group() const override { return true; }
  void step_group(torch::optim::OptimizerParamGroup& group, OptimizerStateMap& state) const override {
    muon_step_group(group, state);
  }
};

}  // namespace

Muon::Muon(std::vector<at::Tensor> params, MuonOptions defaults)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                              std::make_unique<MuonOptions>(defaults)) {
  for (const auto& group : param_groups()) validate_muon_group(group);
}

at::Tensor Muon::step(LossClosure closure) {
  const at::Tensor loss = detail::evaluate_closure(closure);
  at::NoGradGuard no_grad;
  for (auto& group : param_groups()) muon_step_group(group, state());
  return loss;
}

std::shared_ptr<const OptimizerKind> detail::muon_kind() { return std::make_shared<MuonKind>(); }

}  // namespace hp
