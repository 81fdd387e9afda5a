// Neural-network ops: softmax / log_softmax and their backwards, nll_loss and its backward,
// embedding and its backward.
//
//   softmax-like   the softmax dim must be whole: a shard there (or a Partial) is gathered first;
//                  shards of other dims stay, and every operand follows the first
//   nll_loss       a batch shard (self S(0) with target S(0)) stays sharded for reduction none,
//                  becomes P(sum) for reduction sum; reduction mean (whose divisor depends on the
//                  targets of all ranks) and class shards are replicated first
//   embedding      a replicated table follows the indices' shards; a table sharded on its
//                  embedding dim (S(1)) gives output sharded on the last dim; a vocab-sharded
//                  table (S(0)) with replicated indices gives a Partial(sum) output: each rank
//                  looks up the rows it holds and zeros the rest (its backward is replicated)
//   layer norm     the normalized (trailing) dims must be whole; shards of leading dims stay, and
//                  the weight/bias gradients of a row-sharded input are Partial(sum)
#include "dtensor/rules/rules.h"

namespace hp::rules {
namespace {

constexpr int64_t kReductionNone = 0, kReductionSum = 2;

int64_t norm(int64_t d, int64_t ndim) { return d < 0 ? d + ndim : d; }

// Every operand shaped like input 0; the softmax dim `dim` must not be split.
OpSharding softmax_like(const OpCall& call, int64_t dim) {
  dim = norm(dim, call.inputs[0].ndim());
  OpSharding s;
  s.inputs.assign(call.inputs.size(), replicated(call.mesh_ndim()));
  s.outputs.assign(call.output_shapes.size(), replicated(call.mesh_ndim()));
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement lead = call.inputs[0].placements()[i];
    if (lead.is_shard() && lead.dim() != dim) {
      for (auto& in : s.inputs) in[i] = lead;
      for (auto& out : s.outputs) out[i] = lead;
    }
  }
  return s;
}

OpSharding nll_loss_forward(const OpCall& call) {
  // (self, target, weight?, reduction, ignore_index) -> (output, total_weight)
  const int64_t reduction = call.args[3].toInt();
  OpSharding s = all_replicated(call, 2);
  const bool batched = call.inputs[0].ndim() == 2;
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement self = call.inputs[0].placements()[i];
    if (!batched || !self.is_shard(0) || (reduction != kReductionNone && reduction != kReductionSum)) continue;
    s.inputs[0][i] = Shard(0);
    s.inputs[1][i] = Shard(0);  // the target follows the rows
    s.outputs[0][i] = reduction == kReductionNone ? Shard(0) : Partial();
    s.outputs[1][i] = Partial();  // total_weight: a sum of per-row weights
  }
  return s;
}

OpSharding nll_loss_backward(const OpCall& call) {
  // (grad_output, self, target, weight?, reduction, ignore_index, total_weight) -> grad_input
  const int64_t reduction = call.args[4].toInt();
  OpSharding s = all_replicated(call, 1);
  const bool batched = call.inputs[1].ndim() == 2;
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement self = call.inputs[1].placements()[i];
    if (!batched || !self.is_shard(0) || (reduction != kReductionNone && reduction != kReductionSum)) continue;
    s.inputs[0][i] = reduction == kReductionNone ? Shard(0) : Replicate();
    s.inputs[1][i] = Shard(0);
    s.inputs[2][i] = Shard(0);
    s.outputs[0][i] = Shard(0);
  }
  return s;
}

// This rank's rows of a vocab-sharded table: indices outside [lo, lo + rows) look up nothing.
c10::IValue vocab_sharded_lookup(const std::vector<c10::IValue>& args, const DTensorSpec&,
                                 const std::vector<DTensorSpec>& inputs) {
  const at::Tensor weight = args[0].toTensor(), indices = args[1].toTensor();
  const auto [rows, offset] = inputs[0].local_shape_and_offset(*inputs[0].mesh().get_coordinate());
  const at::Tensor outside = (indices < offset[0]).logical_or(indices >= offset[0] + rows[0]);
  std::vector<int64_t> out_shape = indices.sizes().vec();
  out_shape.push_back(weight.size(1));
  if (rows[0] == 0) return at::zeros(out_shape, weight.options());
  at::Tensor out = at::embedding(weight, (indices - offset[0]).masked_fill(outside, 0));
  return out.masked_fill_(outside.unsqueeze(-1), 0);
}

OpSharding embedding(const OpCall& call) {
  // (weight [V, D], indices, padding_idx, scale_grad_by_freq, sparse) -> [*indices, D]
  std::vector<int64_t> out_shape = call.inputs[1].shape();
  out_shape.push_back(call.inputs[0].shape()[1]);
  const int64_t out_last = static_cast<int64_t>(out_shape.size()) - 1;
  OpSharding s = all_replicated(call, 1);
  s.output_shapes = {out_shape};  // embedding has no meta kernel
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement weight = call.inputs[0].placements()[i], indices = call.inputs[1].placements()[i];
    if (weight.is_shard(1)) {  // embedding-dim shard: every rank looks up all indices
      s.inputs[0][i] = weight;
      s.outputs[0][i] = Shard(out_last);
    } else if (weight.is_shard(0) && call.args[2].toInt() < 0) {  // vocab shard (no padding_idx)
      s.inputs[0][i] = weight;
      s.outputs[0][i] = Partial();
      s.local_kernel = vocab_sharded_lookup;
    } else if (indices.is_shard()) {  // replicated table, sharded indices
      s.inputs[1][i] = indices;
      s.outputs[0][i] = indices;
    }
  }
  return s;
}

OpSharding embedding_backward(const OpCall& call) {
  // (grad_output [..., D], indices, num_weights, padding_idx, scale_grad_by_freq) -> grad weight [V, D]
  const int64_t grad_last = call.inputs[0].ndim() - 1;
  OpSharding s = all_replicated(call, 1);
  s.output_shapes = {{call.args[2].toInt(), call.inputs[0].shape()[grad_last]}};  // no meta kernel
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement grad = call.inputs[0].placements()[i], indices = call.inputs[1].placements()[i];
    if (grad.is_shard(grad_last)) {
      s.inputs[0][i] = grad;
      s.outputs[0][i] = Shard(1);
    } else if (grad.is_shard() && indices == grad) {  // rows of a batch shard: each rank's sum is partial
      s.inputs[0][i] = grad;
      s.inputs[1][i] = indices;
      s.outputs[0][i] = Partial();
    } else if (grad.is_partial() && grad.reduce_op() == comm::ReduceOp::kSum) {
      s.inputs[0][i] = grad;
      s.outputs[0][i] = grad;
    }
  }
  return s;
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
OpSharding layer_norm(const OpCall& call) {
  const int64_t normalized = static_cast<int64_t>(call.args[1].toIntVector().size());
  const int64_t lead = call.inputs[0].ndim() - normalized;  // dims before the normalized ones
  OpSharding s = all_replicated(call, 3);
  std::vector<int64_t> stats = call.inputs[0].shape();  // mean and rstd: [*lead, 1, ..., 1]
  std::fill(stats.begin() + lead, stats.end(), 1);
  s.output_shapes = {call.inputs[0].shape(), stats, stats};  // no meta kernel in LibTorch 1.13
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement p = call.inputs[0].placements()[i];
    if (!p.is_shard() || p.dim() >= lead) continue;
    s.inputs[0][i] = p;
    for (auto& out : s.outputs) out[i] = p;
  }
  return s;
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?, mask)
//   -> (grad_input, grad_weight, grad_bias)
OpSharding layer_norm_backward(const OpCall& call) {
  const int64_t normalized = static_cast<int64_t>(call.args[2].toIntVector().size());
  const int64_t lead = call.inputs[1].ndim() - normalized;
  OpSharding s = all_replicated(call, 3);
  const std::vector<int64_t> params = call.args[2].toIntVector();
  s.output_shapes = {call.inputs[1].shape(), params, params};
  for (int64_t i = 0; i < call.mesh_ndim(); ++i) {
    const Placement p = call.inputs[1].placements()[i];
    if (!p.is_shard() || p.dim() >= lead) continue;
    for (size_t k = 0; k < 4; ++k) s.inputs[k][i] = p;  // grad_out, input, mean, rstd share the rows
    s.outputs[0][i] = p;
    s.outputs[1][i] = Partial();  // sums over rows, each rank over its own
    s.outputs[2][i] = Partial();
  }
  return s;
}

}  // namespace

void register_nn_rules(const Register& add) {
  add("aten::native_layer_norm", layer_norm);
  // gather / scatter along `dim`: that dim must be whole.
  add("aten::gather", [](const OpCall& c) { return softmax_like(c, c.args[1].toInt()); });
  for (const char* op :
       {"aten::scatter.src", "aten::scatter_add", "aten::scatter_add_"})  // scatter_add_: gather's backward
    add(op, [](const OpCall& c) { return softmax_like(c, c.args[1].toInt()); });
  add("aten::native_layer_norm_backward", layer_norm_backward);
  for (const char* op : {"aten::_softmax", "aten::_log_softmax"})
    add(op, [](const OpCall& c) { return softmax_like(c, c.args[1].toInt()); });
  for (const char* op : {"aten::_softmax_backward_data", "aten::_log_softmax_backward_data"})
    add(op, [](const OpCall& c) { return softmax_like(c, c.args[2].toInt()); });
  add("aten::nll_loss_forward", nll_loss_forward);
  add("aten::nll_loss_backward", nll_loss_backward);
  add("aten::embedding", embedding);
  add("aten::embedding_dense_backward", embedding_backward);
}

}  // namespace hp::rules
