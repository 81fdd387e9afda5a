#include "hp/models/parallelize.h"

#include <sstream>

#include "hp/core/error.h"

namespace hp::models {

void ParallelDims::validate(int64_t world_size, const LlamaConfig& model) const {
  for (auto [name, value] : {std::pair<const char*, int64_t>{"dp_replicate", dp_replicate}, {"dp_shard", dp_shard},
                             {"tp", tp}, {"pp", pp}, {"cp", cp}, {"ep", ep}})
    HP_CHECK(value >= 1, "parallel.", name, " must be >= 1, got ", value);
  HP_CHECK(cp == 1 && ep == 1, "parallel.cp and parallel.ep are reserved for context and expert parallelism and must be 1");
  HP_CHECK(product() == world_size, "parallel dims ", str(), " multiply to ", product(), " but the world has ",
           world_size, " ranks");
  if (tp > 1) {
    HP_CHECK(model.heads % tp == 0 && model.kv_heads % tp == 0, "model.heads (", model.heads, ") and model.kv_heads (",
             model.kv_heads, ") must be divisible by parallel.tp (", tp, ")");
    HP_CHECK(model.ffn_hidden % tp == 0, "model.ffn_hidden (", model.ffn_hidden, ") must be divisible by parallel.tp (",
             tp, ")");
    HP_CHECK(model.vocab % tp == 0, "model.vocab (", model.vocab, ") must be divisible by parallel.tp (", tp, ")");
    HP_CHECK(!model.tie_embeddings, "model.tie_embeddings is not supported with parallel.tp > 1 yet");
    HP_CHECK(!model.qk_norm, "model.qk_norm is not supported with parallel.tp > 1 yet");
  }
}

std::string ParallelDims::str() const {
  std::ostringstream out;
  out << "dp_replicate=" << dp_replicate << " dp_shard=" << dp_shard << " tp=" << tp << " pp=" << pp;
  return out.str();
}

DeviceMesh build_mesh(const comm::ProcessGroup& world, const ParallelDims& dims) {
  return init_device_mesh(world, "cpu", {dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp},
                          {"pp", "dp_replicate", "dp_shard", "tp"});
}

ParallelizePlan llama_tp_plan(TpOptions o) {
  // Between blocks the residual stream is replicated, or sharded on the sequence dim with SP.
  const Placement between = o.sequence_parallel ? Shard(1) : Replicate();
  ParallelizePlan plan = {
      {"embed", RowwiseParallel().set_input_layouts(Replicate()).set_output_layouts(between)},
      {"layers.*.attn.q_proj", ColwiseParallel()},
      {"layers.*.attn.k_proj", ColwiseParallel()},
      {"layers.*.attn.v_proj", ColwiseParallel()},
      {"layers.*.attn.o_proj", RowwiseParallel().set_output_layouts(between)},
      {"layers.*.mlp.gate", ColwiseParallel()},
      {"layers.*.mlp.up", ColwiseParallel()},
      {"layers.*.mlp.down", RowwiseParallel().set_output_layouts(between)},
      {"output", ColwiseParallel()
                     .set_input_layouts(between)
                     .set_output_layouts(o.loss_parallel ? Shard(-1) : Replicate())
                     .set_use_local_output(!o.loss_parallel)},
  };
  if (o.sequence_parallel)
    for (const char* norm : {"layers.*.attn_norm", "layers.*.mlp_norm", "norm"}) plan.push_back({norm, SequenceParallel()});
  // Attention and MLP inputs become replicated DTensors once, so q/k/v (gate/up) share them and
  // their input gradients add up as Partial before one all_reduce (or reduce_scatter with SP).
  for (const char* input : {"layers.*.attn", "layers.*.mlp"})
    plan.push_back({input, PrepareModuleInput({between}, {Replicate()})});
  return plan;
}

void parallelize_llama(Llama& model, const DeviceMesh& mesh, const ParallelDims& dims,
                       const LlamaParallelOptions& options) {
  if (dims.tp > 1) parallelize_module(model, mesh["tp"], llama_tp_plan(options.tp));
  if (dims.dp() == 1) return;
  const DeviceMesh dp_mesh = dims.dp_replicate > 1 ? mesh[{"dp_replicate", "dp_shard"}] : mesh["dp_shard"];
  // Blocks first, then the root (FSDP2's recipe). A mixed-precision output dtype applies to the
  // root only: blocks hand their outputs on in the compute dtype.
  FullyShardOptions block_options = options.fsdp;
  block_options.mixed_precision.output_dtype.reset();
  for (auto& [fqn, block] : nn::match_modules(model, "layers.*")) fully_shard(*block, dp_mesh, block_options);
  fully_shard(model, dp_mesh, options.fsdp);
}

}  // namespace hp::models
