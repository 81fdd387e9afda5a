// The reduction rule (ops/reduction.yaml lists the ops): sum, mean, amax/amin over some or all dims.
//
// Per mesh dim: a shard of a reduced dim makes the output Partial (sum -> P(sum), amax -> P(max),
// mean -> P(avg); mean and amax/amin only when every split is even, since the mean of uneven
// pieces is not the average of their means and an empty piece has no maximum); a shard of a kept dim stays a shard of
// the matching output dim; Partial inputs stay Partial where the reduction is linear in them (sum/mean of P(sum|avg),
// amax of P(max)); everything else is reduced to Replicate first.
#include "dtensor/rules/rules.h"

namespace hp::rules {
namespace {

OpSharding reduce(const OpCall& call, Reduction kind, int dims_arg_index, int keepdim_arg_index) {
  const DTensorSpec& in = call.inputs.at(0);
  const int64_t ndim = in.ndim();
  const std::vector<int64_t> reduced =
      dims_arg_index < 0 ? dims_arg(c10::IValue(), ndim) : dims_arg(call.args.at(dims_arg_index), ndim);
  const bool keepdim = keepdim_arg_index >= 0 && call.args.at(keepdim_arg_index).toBool();
  auto is_reduced = [&](int64_t d) { return std::find(reduced.begin(), reduced.end(), d) != reduced.end(); };
  const comm::ReduceOp partial_op = kind == Reduction::kSum    ? comm::ReduceOp::kSum
                                    : kind == Reduction::kMean ? comm::ReduceOp::kAvg
                                    : kind == Reduction::kMax  ? comm::ReduceOp::kMax
                                                               : comm::ReduceOp::kMin;
  OpSharding s;
  s.inputs = {in.placements()};
  s.outputs = {replicated(call.mesh_ndim())};
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement p = in.placements()[i];
    if (p.is_shard()) {
      const int64_t d = p.dim();
      if (!is_reduced(d)) {
        int64_t out_d = d;
        if (!keepdim)
          for (int64_t r : reduced) out_d -= r < d ? 1 : 0;
        s.outputs[0][i] = Shard(out_d);
      } else if (kind == Reduction::kSum || evenly_split(in, d, i)) {
        // mean needs equal pieces; amax/amin need non-empty ones (an empty piece has no maximum)
        s.outputs[0][i] = Partial(partial_op);
      } else {
        s.inputs[0][i] = Replicate();
      }
    } else if (p.is_partial()) {
      const bool linear = (kind == Reduction::kSum || kind == Reduction::kMean)
                              ? (p.reduce_op() == comm::ReduceOp::kSum || p.reduce_op() == comm::ReduceOp::kAvg)
                              : p.reduce_op() == partial_op;
      if (linear)
        s.outputs[0][i] = p;
      else
        s.inputs[0][i] = Replicate();
    }
  }
  return s;
}

// max.dim / min.dim (self, dim, keepdim) -> (values, indices): indices are positions in the whole
// dim, so a shard of the reduced dim is gathered first; shards of other dims stay.
OpSharding reduce_with_indices(const OpCall& call) {
  const DTensorSpec& in = call.inputs.at(0);
  const int64_t dim = dims_arg(call.args.at(1), in.ndim()).at(0);
  const bool keepdim = call.args.at(2).toBool();
  OpSharding s = all_replicated(call, 2);
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement p = in.placements()[i];
    if (!p.is_shard() || p.dim() == dim) continue;
    s.inputs[0][i] = p;
    const Placement out = Shard(!keepdim && p.dim() > dim ? p.dim() - 1 : p.dim());
    for (auto& o : s.outputs) o[i] = out;
  }
  return s;
}

}  // namespace

void register_indexed_reduction_rules(const Register& add) {
  add("aten::max.dim", reduce_with_indices);
  add("aten::min.dim", reduce_with_indices);
}

ShardingRule reduction_rule(Reduction kind, int dims_arg_index, int keepdim_arg_index) {
  return [=](const OpCall& call) { return reduce(call, kind, dims_arg_index, keepdim_arg_index); };
}

}  // namespace hp::rules
