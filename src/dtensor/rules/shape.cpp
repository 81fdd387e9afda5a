// Shape ops: t, transpose, permute, unsqueeze, squeeze, expand, view/reshape, slice, select.
//
// They move data only by re-indexing, so a shard follows its tensor dim to wherever the op puts
// it; Partial stays Partial (re-indexing is linear). A shard on a dim the op cuts into, expands
// or merges unevenly is reduced to Replicate first.
#include "dtensor/rules/rules.h"

namespace hp::rules {
namespace {

// Builds a rule from a map "input dim -> output dim, or -1 if a shard there must be gathered".
OpSharding follow_dims(const OpCall& call, const std::function<int64_t(int64_t)>& out_dim_of) {
  const DTensorSpec& in = call.inputs.at(0);
  OpSharding s;
  s.inputs.assign(call.inputs.size(), replicated(call.mesh_ndim()));
  s.inputs[0] = in.placements();
  s.outputs.assign(call.output_shapes.size(), in.placements());
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement p = in.placements()[i];
    if (!p.is_shard()) continue;
    const int64_t od = out_dim_of(p.dim());
    if (od >= 0) {
      for (auto& out : s.outputs) out[i] = Shard(od);
    } else {
      s.inputs[0][i] = Replicate();
      for (auto& out : s.outputs) out[i] = Replicate();
    }
  }
  return s;
}

int64_t norm(int64_t d, int64_t ndim) { return d < 0 ? d + ndim : d; }

// view/reshape: groups of input and output dims with equal products. A shard survives when its dim
// maps one-to-one, or leads a merge/split and every split is even (so pieces stay torch.chunk
// pieces of the new dim).
OpSharding view_rule(const OpCall& call) {
  const DTensorSpec& in = call.inputs.at(0);
  const auto& a = in.shape();
  const auto& b = call.output_shape(0);
  std::vector<int64_t> out_of(a.size(), -1);
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const size_t i0 = i, j0 = j;
    int64_t pa = a[i++], pb = b[j++];
    while (pa != pb) {
      if (pa < pb && i < a.size())
        pa *= a[i++];
      else if (pb < pa && j < b.size())
        pb *= b[j++];
      else
        break;
    }
    if (pa != pb) break;
    const bool one_to_one = i - i0 == 1 && j - j0 == 1;
    out_of[i0] = one_to_one ? static_cast<int64_t>(j0) : -2 - static_cast<int64_t>(j0);  // -2-j: leads a group
  }
  OpSharding s = follow_dims(call, [&](int64_t d) -> int64_t {
    if (out_of[d] >= 0) return out_of[d];
    if (out_of[d] == -1) return -1;
    const int64_t j0 = -2 - out_of[d];
    for (int64_t m = 0; m < call.mesh_ndim(); ++m)
      if (in.placements()[m].is_shard(d) && !evenly_split(in, d, m)) return -1;
    // The leading output dim must itself split evenly by the same mesh sizes.
    int64_t parts = 1;
    for (int64_t m = 0; m < call.mesh_ndim(); ++m)
      if (in.placements()[m].is_shard(d)) parts *= in.mesh().size(m);
    return b[j0] % parts == 0 ? j0 : -1;
  });
  s.local_shape_arg = 1;  // view(self, size), _reshape_alias(self, size, stride)
  if (call.op == "aten::_reshape_alias") {
    s.local_stride_arg = 2;
    s.strides_view_input = true;
  }
  return s;
}

// cat / stack: every operand must agree per mesh dim; a shard of a dim other than the joined
// one survives, as does a common linear Partial; anything else is replicated.
OpSharding join(const OpCall& call, int64_t dim, bool new_dim) {
  OpSharding s = all_replicated(call, 1);
  const int64_t ndim = call.inputs[0].ndim();
  dim = norm(dim, new_dim ? ndim + 1 : ndim);
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement lead = call.inputs[0].placements()[i];
    bool same = true;
    for (const auto& in : call.inputs) same = same && in.placements()[i] == lead && in.ndim() == ndim;
    if (!same) continue;
    if (lead.is_shard() && (new_dim || lead.dim() != dim)) {
      for (auto& in : s.inputs) in[i] = lead;
      s.outputs[0][i] = new_dim && lead.dim() >= dim ? Shard(lead.dim() + 1) : lead;
    } else if (lead.is_partial() && lead.reduce_op() == comm::ReduceOp::kSum) {
      for (auto& in : s.inputs) in[i] = lead;
      s.outputs[0][i] = lead;
    }
  }
  return s;
}

}  // namespace

void register_shape_rules(const Register& add) {
  add("aten::cat", [](const OpCall& c) { return join(c, c.args[1].toInt(), false); });
  add("aten::stack", [](const OpCall& c) { return join(c, c.args[1].toInt(), true); });
  for (const char* op : {"aten::split.Tensor", "aten::split_with_sizes"}) {
    add(op, [](const OpCall& c) {
      const int64_t cut = norm(c.args[2].toInt(), c.inputs[0].ndim());
      return follow_dims(c, [=](int64_t d) { return d == cut ? -1 : d; });
    });
  }
  add("aten::t",
      [](const OpCall& c) { return follow_dims(c, [&](int64_t d) { return c.inputs[0].ndim() < 2 ? d : 1 - d; }); });
  add("aten::transpose.int", [](const OpCall& c) {
    const int64_t n = c.inputs[0].ndim();
    const int64_t a = norm(c.args[1].toInt(), n), b = norm(c.args[2].toInt(), n);
    return follow_dims(c, [=](int64_t d) { return d == a ? b : d == b ? a : d; });
  });
  add("aten::permute", [](const OpCall& c) {
    const int64_t n = c.inputs[0].ndim();
    const std::vector<int64_t> order = c.args[1].toIntVector();
    return follow_dims(c, [&](int64_t d) {
      for (int64_t k = 0; k < n; ++k)
        if (norm(order[k], n) == d) return k;
      return int64_t{-1};
    });
  });
  add("aten::unsqueeze", [](const OpCall& c) {
    const int64_t at = norm(c.args[1].toInt(), c.inputs[0].ndim() + 1);
    return follow_dims(c, [=](int64_t d) { return d >= at ? d + 1 : d; });
  });
  add("aten::squeeze.dim", [](const OpCall& c) {
    const int64_t n = c.inputs[0].ndim();
    const int64_t at = norm(c.args[1].toInt(), n);
    const bool removed = c.inputs[0].shape()[at] == 1;
    return follow_dims(c, [=](int64_t d) { return removed && d > at ? d - 1 : d; });
  });
  add("aten::expand", [](const OpCall& c) {
    const auto& in_shape = c.inputs[0].shape();
    const auto& out_shape = c.output_shape(0);
    const int64_t offset = static_cast<int64_t>(out_shape.size() - in_shape.size());
    OpSharding s = follow_dims(c, [&](int64_t d) { return in_shape[d] == out_shape[d + offset] ? d + offset : -1; });
    s.local_shape_arg = 1;  // expand(self, size)
    return s;
  });
  for (const char* op : {"aten::view", "aten::_unsafe_view", "aten::_reshape_alias"})  // reshape decomposes into these
    add(op, view_rule);
  add("aten::slice.Tensor", [](const OpCall& c) {
    const int64_t cut = norm(c.args[1].toInt(), c.inputs[0].ndim());
    return follow_dims(c, [=](int64_t d) { return d == cut ? -1 : d; });
  });
  // slice_backward(grad, input_sizes, dim, ...) / select_backward(grad, input_sizes, dim, index):
  // the grad is scattered into zeros of the input's shape; shards of other dims carry over.
  add("aten::slice_backward", [](const OpCall& c) {
    const int64_t cut = norm(c.args[2].toInt(), c.inputs[0].ndim());
    OpSharding s = follow_dims(c, [=](int64_t d) { return d == cut ? -1 : d; });
    s.local_shape_arg = 1;
    return s;
  });
  add("aten::select_backward", [](const OpCall& c) {
    const int64_t cut = norm(c.args[2].toInt(), c.inputs[0].ndim() + 1);
    OpSharding s = follow_dims(c, [=](int64_t d) { return d >= cut ? d + 1 : d; });
    s.local_shape_arg = 1;
    return s;
  });
  add("aten::select.int", [](const OpCall& c) {
    const int64_t cut = norm(c.args[1].toInt(), c.inputs[0].ndim());
    return follow_dims(c, [=](int64_t d) { return d == cut ? -1 : d > cut ? d - 1 : d; });
  });
}

}  // namespace hp::rules
