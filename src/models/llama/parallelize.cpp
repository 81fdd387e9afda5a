#include "hp/models/llama/parallelize.h"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/models/llama/pipeline.h"
#include "hp/parallel/loss_parallel.h"
#include "hp/pp/schedule.h"

namespace hp::models {

void validate_llama_dims(const ParallelDims& dims, const LlamaConfig& model, LlamaMlp mlp) {
  HP_CHECK(dims.ep == 1,
           "parallel.ep is for expert parallelism, which a dense llama has no use for: it must be 1 (got ", dims.ep,
           ")");
  if (dims.tp > 1) {
    HP_CHECK(model.heads % dims.tp == 0 && model.kv_heads % dims.tp == 0, "model.heads (", model.heads,
             ") and model.kv_heads (", model.kv_heads, ") must be divisible by parallel.tp (", dims.tp, ")");
    HP_CHECK(mlp != LlamaMlp::kDense || model.ffn_hidden % dims.tp == 0, "model.ffn_hidden (", model.ffn_hidden,
             ") must be divisible by parallel.tp (", dims.tp, ")");
    HP_CHECK(model.vocab % dims.tp == 0, "model.vocab (", model.vocab, ") must be divisible by parallel.tp (", dims.tp,
             ")");
    HP_CHECK(!model.tie_embeddings, "model.tie_embeddings is not supported with parallel.tp > 1 yet");
  }
}

ParallelizePlan llama_tp_plan(TpOptions o, LlamaMlp mlp) {
  HP_CHECK(!o.async_tp || (o.sequence_parallel && o.wire == comm::WireFormat::kNative),
           "async TP needs sequence parallelism and native reductions");
  // Between blocks the residual stream is replicated, or sharded on the sequence dim with SP.
  const Placement between = o.sequence_parallel ? Shard(1) : Replicate();
  // With async TP the layers that take the stream gather it fused with their matmuls, and the
  // layers that give it back reduce-scatter fused with theirs.
  const auto takes_stream = [&] { return ColwiseParallel().set_input_layouts(between).set_async_tp(o.async_tp); };
  const auto gives_stream = [&] {
    return RowwiseParallel().set_output_layouts(between).set_reduce_wire(o.wire).set_async_tp(o.async_tp);
  };
  // Without it, q/k/v (gate/up) take attention's (the MLP's) input replicated by PrepareModuleInput.
  const auto takes_block_input = [&] { return o.async_tp ? takes_stream() : ColwiseParallel(); };
  // o.wire goes where the plan reduces: Rowwise outputs in forward, and in backward the gradients of
  // inputs laid out once (the LM head's, and attention's and the MLP's through PrepareModuleInput).
  ParallelizePlan plan = {
      {"embed", RowwiseParallel().set_input_layouts(Replicate()).set_output_layouts(between).set_reduce_wire(o.wire)},
      {"layers.*.attn.q_proj", takes_block_input()},
      {"layers.*.attn.k_proj", takes_block_input()},
      {"layers.*.attn.v_proj", takes_block_input()},
      {"layers.*.attn.o_proj", gives_stream()},
      {"output", takes_stream()
                     .set_output_layouts(o.loss_parallel ? Shard(-1) : Replicate())
                     .set_use_local_output(!o.loss_parallel)
                     .set_reduce_wire(o.wire)},
  };
  if (o.sequence_parallel)
    for (const char* norm : {"layers.*.attn_norm", "layers.*.mlp_norm", "norm"})
      plan.push_back({norm, SequenceParallel()});
  // Attention and MLP inputs become replicated DTensors once, so q/k/v (gate/up) share them and
  // their input gradients add up as Partial before one all_reduce (or reduce_scatter with SP).
  // With async TP, q/k/v (gate/up) share one fused gather of their input instead.
  if (!o.async_tp)
    plan.push_back({"layers.*.attn", PrepareModuleInput({between}, {Replicate()}).set_reduce_wire(o.wire)});
  else if (o.share_input_gathers)
    plan.push_back({"layers.*.attn", ShareInputGather({"q_proj", "k_proj", "v_proj"}, between)});
  if (mlp == LlamaMlp::kDense) {
    plan.push_back({"layers.*.mlp.gate", takes_block_input()});
    plan.push_back({"layers.*.mlp.up", takes_block_input()});
    plan.push_back({"layers.*.mlp.down", gives_stream()});
    if (!o.async_tp)
      plan.push_back({"layers.*.mlp", PrepareModuleInput({between}, {Replicate()}).set_reduce_wire(o.wire)});
    else if (o.share_input_gathers)
      plan.push_back({"layers.*.mlp", ShareInputGather({"gate", "up"}, between)});
  } else {
    // This rank's tokens in (a local tensor: the MLP has no DTensor parameters), the stream's
    // layout out.
    plan.push_back({"layers.*.mlp", PrepareModuleInput({between}, {Shard(1)}, /*use_local_output=*/true)});
    plan.push_back({"layers.*.mlp", PrepareModuleOutput(Shard(1), between)});
  }
  return plan;
}

ShardPlacementFn split_short_matrices_by_columns(ShardPlacementFn user, int64_t ranks) {
  return [user = std::move(user), ranks](const std::string& fqn, const at::Tensor& p) -> std::optional<Placement> {
    if (user)
      if (auto chosen = user(fqn, p)) return chosen;
    if (p.dim() == 2 && p.size(0) < ranks && p.size(1) >= ranks) return Shard(1);
    return std::nullopt;
  };
}

void shard_over_data_and_tp(nn::Module& model, const std::vector<std::string>& patterns, const DeviceMesh& mesh,
                            const ParallelDims& dims, const RecipeOptions& recipe) {
  HP_CHECK(dims.tp > 1, "shard_over_data_and_tp: needs parallel.tp > 1");
  // The expert mesh without expert parallelism: (pp, dp_replicate, dp_shard x cp x tp).
  ParallelDims flat = dims;
  flat.ep = 1;
  const DeviceMesh data_and_tp = build_expert_mesh(mesh.world(), flat, mesh.device_type());
  FullyShardOptions options = recipe.fsdp;
  options.shard_placement_fn =
      split_short_matrices_by_columns(std::move(options.shard_placement_fn), data_and_tp.size("efsdp"));
  options.mixed_precision.output_dtype.reset();
  const DeviceMesh unit_mesh = expert_data_parallel_mesh(data_and_tp, dims);
  const auto stages =
      llama_layer_stages(dims, recipe, static_cast<int64_t>(nn::match_modules(model, "layers.*").size()));
  for (const std::string& pattern : patterns)
    for (auto& [fqn, module] : nn::match_modules(model, pattern))
      fully_shard(*module, unit_mesh, recipe.unit_fsdp(fqn, options, layer_stage(stages, fqn)))
          .set_gradient_scaling_factor(static_cast<double>(dims.tp));
}

namespace {

// TP on mesh["tp"], and the QK-norms (replicated weights over each tp rank's heads) data-parallel
// over the tp ranks too.
void apply_tensor_parallel(Llama& model, const DeviceMesh& mesh, const ParallelDims& dims, const RecipeOptions& options,
                           LlamaMlp mlp) {
  parallelize_module(model, mesh["tp"], llama_tp_plan(options.tp, mlp));
  // With SP the residual branches leave the block's layers as local sequence pieces: their dropouts
  // see them as DTensors, which say which positions each rank holds.
  if (options.tp.sequence_parallel && model.config().residual_dropout > 0.0)
    parallelize_module(model, mesh["tp"],
                       {{"layers.*.attn_out_dropout", SequenceParallel(1, /*use_local_output=*/true)},
                        {"layers.*.mlp_out_dropout", SequenceParallel(1, /*use_local_output=*/true)}});
  // Each tp rank's core attention holds its share of the heads (for the probabilities' dropout).
  const int64_t local_heads = model.config().heads / dims.tp;
  for (auto& [fqn, core] : nn::match_modules(model, "layers.*.attn.core"))
    static_cast<nn::CoreAttention*>(core)->set_heads(mesh.get_local_rank("tp") * local_heads, model.config().heads);
  if (model.config().qk_norm)
    shard_over_data_and_tp(model, {"layers.*.attn.q_norm", "layers.*.attn.k_norm"}, mesh, dims, options);
}

// CP on mesh["cp"]: every layer's core attention works across the cp ranks.
void apply_context_parallel(Llama& model, const DeviceMesh& mesh, const ParallelDims& dims,
                            const RecipeOptions& options) {
  if (dims.cp > 1) parallelize_module(model, mesh["cp"], {{"layers.*.attn.core", options.cp}});
}

}  // namespace

void parallelize_llama(Llama& model, const DeviceMesh& mesh, const ParallelDims& dims, const RecipeOptions& options,
                       LlamaMlp mlp) {
  if (dims.tp > 1) apply_tensor_parallel(model, mesh, dims, options, mlp);
  apply_context_parallel(model, mesh, dims, options);
  // Without data parallelism a mixed-precision policy or parameter offload still needs FSDP units,
  // of one rank each: they hold the fp32 parameters (offloaded) and compute in the policy's dtype
  // (no communication).
  if (dims.dp() * dims.cp == 1 && !options.fsdp.mixed_precision.param_dtype && !options.fsdp.offload) return;
  const DeviceMesh dp_mesh = data_parallel_mesh(mesh, dims);
  // Blocks first, then the root (FSDP2's recipe). A mixed-precision output dtype applies to the
  // root only: blocks hand their outputs on in the compute dtype.
  FullyShardOptions block_options = options.fsdp;
  block_options.mixed_precision.output_dtype.reset();
  std::vector<nn::Module*> blocks;
  for (auto& [fqn, block] : nn::match_modules(model, "layers.*")) {
    fully_shard(*block, dp_mesh, options.unit_fsdp(fqn, block_options));
    blocks.push_back(block);
  }
  fully_shard(model, dp_mesh, options.unit_fsdp("root", options.fsdp));
  // With offload, every unit gathers (reading offloaded shards from the tier) offload_prefetch
  // blocks ahead.
  if (options.fsdp.offload) set_prefetch_depth(model, blocks, options.offload_prefetch);
}

namespace {

// The layers of each stage of `schedule`: options.layers_per_stage, else equal ranges.
std::vector<int64_t> stage_layer_counts(const pp::Schedule& schedule, const PipelineOptions& options, int64_t layers) {
  const std::vector<int64_t>& chosen = options.layers_per_stage;
  HP_CHECK(chosen.empty() || static_cast<int>(chosen.size()) == schedule.stages, "parallelize_llama: ", chosen.size(),
           " layer counts for the ", schedule.stages, " stages of ", schedule.name);
  return chosen.empty() ? std::vector<int64_t>(schedule.stages, layers / schedule.stages) : chosen;
}

pp::Schedule pipeline_schedule(const ParallelDims& dims, const PipelineOptions& options) {
  return pp::schedule_by_name(options.schedule, static_cast<int>(dims.pp), options.micro_batches,
                              options.stages_per_rank, options.costs);
}

}  // namespace

std::vector<std::string> llama_layer_stages(const ParallelDims& dims, const RecipeOptions& options, int64_t layers) {
  std::vector<std::string> stages(static_cast<size_t>(layers));
  if (dims.pp == 1) return stages;
  const std::vector<int64_t> counts =
      stage_layer_counts(pipeline_schedule(dims, options.pipeline), options.pipeline, layers);
  size_t layer = 0;
  for (size_t s = 0; s < counts.size(); ++s)
    for (int64_t i = 0; i < counts[s] && layer < stages.size(); ++i)
      stages[layer++] = stage_unit_name(static_cast<int64_t>(s));
  return stages;
}

std::string layer_stage(const std::vector<std::string>& stages, const std::string& fqn) {
  const std::string prefix = "layers.";
  if (stages.empty() || stages.front().empty() || fqn.rfind(prefix, 0) != 0) return {};
  // "layers.3.mlp.experts" -> 3
  const std::string index = fqn.substr(prefix.size(), fqn.find('.', prefix.size()) - prefix.size());
  if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) return {};
  const size_t layer = std::stoul(index);
  return layer < stages.size() ? stages[layer] : std::string();
}

namespace {

// This rank's pipeline stages, each one FSDP unit on the data-parallel mesh (of one rank when
// dp = 1, which keeps gradients, clipping and checkpoints on the same DTensor path), and the
// executor of this data-parallel replica's pipeline: its (pp, tp) ranks.
void split_into_pipeline(ModelParts& parts, Llama& model, const DeviceMesh& mesh, const ParallelDims& dims,
                         const RecipeOptions& options) {
  const LlamaConfig& config = model.config();
  const int pp_rank = static_cast<int>(mesh.get_local_rank("pp"));
  const pp::Schedule schedule = pipeline_schedule(dims, options.pipeline);
  const auto all = split_llama(model, stage_layer_counts(schedule, options.pipeline, config.layers));
  const DeviceMesh dp_mesh = data_parallel_mesh(mesh, dims);
  parts.fsdp_units = fsdp_unit_names(model, schedule.stages);  // the other ranks' stages too
  // Between stages, the residual stream is whole on every TP rank, or sharded on the sequence with SP.
  const int64_t boundary_dim = options.tp.sequence_parallel ? 1 : -1;
  std::vector<pp::PipelineStage> local;
  for (int st = 0; st < schedule.stages; ++st)
    if (schedule.stage_rank[st] == pp_rank) {
      fully_shard(*all[st], dp_mesh, options.unit_fsdp(stage_unit_name(st), options.fsdp));
      pp::PipelineStage stage{all[st], st};
      if (st > 0) stage.input_shard_dim = boundary_dim;
      if (st < schedule.stages - 1) stage.output_shard_dim = boundary_dim;
      local.push_back(stage);
      parts.modules.push_back(all[st]);
    }
  // Position p of the pipeline (pipeline rank p) is run by the tp ranks of pp index p: the (pp, tp)
  // sub-mesh is row-major, so its group ranks p * tp .. p * tp + tp - 1.
  const DeviceMesh pipeline_mesh = mesh[{"pp", "tp"}];
  pp::PipelineOptions placement;
  for (int64_t p = 0; p < dims.pp; ++p) {
    placement.position_ranks.emplace_back();
    for (int64_t t = 0; t < dims.tp; ++t) placement.position_ranks.back().push_back(static_cast<int>(p * dims.tp + t));
  }
  const comm::ProcessGroup pipeline_group =
      dims.tp > 1 ? mesh.world().new_group(pipeline_mesh.ranks(), "pp_tp") : mesh.get_group("pp");
  if (config.tie_embeddings) {
    // The first and the last stage each hold the embedding; the first stage's rank saves it and
    // counts its gradient, which the pipeline sums over both copies.
    placement.tied = {{"embed.weight", {0, schedule.stages - 1}}};
    if (pp_rank != 0) parts.copies.insert("embed.weight");
  }
  parts.pipeline =
      std::make_unique<pp::PipelineExecutor>(schedule, std::move(local), pipeline_group, parts.loss, placement);
}

}  // namespace

ModelParts parallelize_llama(std::shared_ptr<Llama> model, const DeviceMesh& mesh, const ParallelDims& dims,
                             const RecipeOptions& options, LlamaMlp mlp) {
  HP_CHECK(model != nullptr, "parallelize_llama: no model");
  validate_llama_dims(dims, model->config(), mlp);
  ModelParts parts;
  parts.model = model;
  // Checkpointing wraps each block's whole call, the plans' hooks included: order does not matter.
  std::vector<CheckpointMode> modes = options.block_checkpoint;
  if (modes.empty()) modes.assign(nn::match_modules(*model, "layers.*").size(), options.checkpoint);
  parts.checkpointed = checkpoint_modules(*model, "layers.*", modes, options.swap);
  parts.loss = [](const at::Tensor& logits, const at::Tensor& targets) { return cross_entropy(logits, targets); };
  for (const char* m : {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate", "mlp.up", "mlp.down"})
    parts.hidden_matrices.push_back(std::string("layers.*.") + m + ".weight");
  parts.other_parameters = {"*.weight", "layers.*.*.weight", "layers.*.attn.q_norm.weight",
                            "layers.*.attn.k_norm.weight"};
  if (dims.pp == 1) {
    parallelize_llama(*model, mesh, dims, options, mlp);
    parts.modules = {model};
    parts.fsdp_units = fsdp_unit_names(*model, 0);
    return parts;
  }
  // Tensor parallelism first, on every rank over the whole model: each rank then runs its stages' share.
  if (dims.tp > 1) apply_tensor_parallel(*model, mesh, dims, options, mlp);
  apply_context_parallel(*model, mesh, dims, options);
  split_into_pipeline(parts, *model, mesh, dims, options);
  return parts;
}

}  // namespace hp::models
