// The pointwise rule (ops/pointwise.yaml lists the ops): pointwise ops with broadcasting, their
// in-place forms and their backward ops.
//
// Per mesh dim: if some input is sharded on a dim that is not broadcast, the output is sharded on
// the matching output dim and every input follows (sharded on its matching dim, or replicated
// where it broadcasts). Otherwise Partial inputs stay Partial only where the op is linear in them:
//   kSumOfPartials  add/sub/lerp: every tensor operand Partial (sum or avg)
//   kOnePartial     mul/div: exactly one Partial operand (the numerator for div), the rest Replicate
//   kUnary          neg, clone, _to_copy, zero_: one operand, Partial stays Partial
// and everything else is reduced to Replicate first. In-place ops keep self's placement, and out=
// forms (".out") the out argument's: the other operands follow it, and a change that would have to
// move it is an error.
#include "dtensor/rules/rules.h"

#include <ATen/ExpandUtils.h>

#include <optional>

#include "hp/core/error.h"

namespace hp::rules {
namespace {

bool linear_partial(const Placement& p) {
  return p.is_partial() && (p.reduce_op() == comm::ReduceOp::kSum || p.reduce_op() == comm::ReduceOp::kAvg);
}

// The broadcast shape of the inputs: the output shape of a pointwise op with no meta kernel.
std::vector<int64_t> broadcast_shape(const OpCall& call) {
  std::vector<int64_t> shape;
  for (const DTensorSpec& in : call.inputs) shape = at::infer_size(shape, in.shape());
  return shape;
}

// `written`: the operand the op writes its result into (self in place, out for ".out"), if any.
OpSharding pointwise(const OpCall& call, Linearity linearity, std::optional<size_t> written) {
  OpSharding s;
  if (call.output_shapes.empty()) s.output_shapes = {written ? call.inputs[*written].shape() : broadcast_shape(call)};
  const auto& out_shape = call.output_shapes.empty() ? s.output_shapes[0] : call.output_shapes[0];
  const int64_t out_ndim = static_cast<int64_t>(out_shape.size());
  const size_t n_inputs = call.inputs.size();
  s.inputs.assign(n_inputs, Placements(call.mesh_ndim(), Replicate()));
  s.outputs.assign(1, Placements(call.mesh_ndim(), Replicate()));
  // Output dim of input k's dim d (right-aligned broadcasting), or -1 if d is broadcast.
  auto out_dim_of = [&](size_t k, int64_t d) -> int64_t {
    const auto& in_shape = call.inputs[k].shape();
    const int64_t od = d + out_ndim - static_cast<int64_t>(in_shape.size());
    return in_shape[d] == out_shape[od] ? od : -1;
  };
  auto in_dim_of = [&](size_t k, int64_t od) -> int64_t {
    const auto& in_shape = call.inputs[k].shape();
    const int64_t d = od - (out_ndim - static_cast<int64_t>(in_shape.size()));
    return d >= 0 && in_shape[d] == out_shape[od] ? d : -1;
  };

  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    auto at = [&](size_t k) { return call.inputs[k].placements()[i]; };
    int64_t out_dim = -1;
    // The written operand decides; otherwise the first input sharded on a non-broadcast dim.
    for (size_t k = 0; k < n_inputs && out_dim < 0; ++k)
      if ((!written || k == *written) && at(k).is_shard()) out_dim = out_dim_of(k, at(k).dim());
    if (out_dim >= 0) {
      for (size_t k = 0; k < n_inputs; ++k) {
        const int64_t d = in_dim_of(k, out_dim);
        s.inputs[k][i] = d >= 0 ? Shard(d) : Replicate();
      }
      for (auto& out : s.outputs) out[i] = Shard(out_dim);
      continue;
    }
    size_t partials = 0;
    for (size_t k = 0; k < n_inputs; ++k) partials += linear_partial(at(k)) ? 1 : 0;
    bool same_op = true;
    for (size_t k = 0; k < n_inputs; ++k)
      if (at(k).is_partial() && at(k) != at(0)) same_op = false;
    bool keep_partial = false;
    if (linearity == Linearity::kSumOfPartials) keep_partial = partials == n_inputs && same_op;
    if (linearity == Linearity::kUnary) keep_partial = n_inputs == 1 && partials == 1;
    if (linearity == Linearity::kOnePartial) {
      // div: only the numerator (input 0) may be Partial.
      const bool numerator_only = call.op.rfind("aten::div", 0) != 0 || linear_partial(at(0));
      keep_partial = partials == 1 && numerator_only;
    }
    // The written operand keeps its placement: a replicated one must not turn Partial (R * P is P).
    if (written && !at(*written).is_partial()) keep_partial = false;
    if (written && at(*written).is_partial() && !keep_partial)
      throw Error(call.op + ": writing into a " + at(*written).str() +
                  " tensor would have to reduce it first; "
                  "redistribute it to Replicate before the op");
    if (keep_partial) {
      for (size_t k = 0; k < n_inputs; ++k) s.inputs[k][i] = at(k).is_partial() ? at(k) : Replicate();
      const Placement partial = linear_partial(at(0)) ? at(0) : [&] {
        for (size_t k = 0; k < n_inputs; ++k)
          if (at(k).is_partial()) return at(k);
        return Replicate();
      }();
      for (auto& out : s.outputs) out[i] = partial;
    }
  }
  if (written && s.inputs[*written] != call.inputs[*written].placements())
    throw Error(call.op + ": writing into a tensor placed " + to_string(call.inputs[*written].placements()) +
                " would have to move it to " + to_string(s.inputs[*written]) + "; redistribute the operands first");
  return s;
}

}  // namespace

ShardingRule pointwise_rule(const std::string& op, Linearity linearity) {
  const bool in_place = op.find("_.") != std::string::npos || op.back() == '_';
  const bool out_form = op.size() > 4 && op.compare(op.size() - 4, 4, ".out") == 0;
  return [linearity, in_place, out_form](const OpCall& call) {
    std::optional<size_t> written;
    if (in_place) written = 0;
    if (out_form && !call.inputs.empty()) written = call.inputs.size() - 1;
    return pointwise(call, linearity, written);
  };
}

}  // namespace hp::rules
