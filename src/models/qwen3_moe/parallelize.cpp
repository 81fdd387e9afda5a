#include "hp/models/qwen3_moe/parallelize.h"

#include <algorithm>
#include <initializer_list>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/core/lambda_backward.h"
#include "hp/models/llama/parallelize.h"
#include "hp/parallel/expert_parallel.h"
#include "hp/parallel/fsdp.h"

namespace hp::models {

void validate_qwen3_moe_dims(const ParallelDims& dims, const Qwen3MoeConfig& config) {
  HP_CHECK(config.experts % dims.ep == 0, "model.experts (", config.experts, ") must be divisible by parallel.ep (",
           dims.ep, ")");
  ParallelDims dense = dims;
  dense.ep = 1;  // the experts' placement is this recipe's; the rest is the llama recipe's
  validate_llama_dims(dense, config.llama, LlamaMlp::kTokenSplit);
}

namespace {

// Each layer's experts as one FSDP unit over the ranks holding the same experts. With a pipeline,
// every layer's: a stage's layers are chosen later, by parallelize_llama, and a unit that never
// runs only holds its shard.
void shard_experts(Llama& model, const DeviceMesh& expert_mesh, const ParallelDims& dims, const Qwen3MoeConfig& config,
                   const RecipeOptions& recipe) {
  FullyShardOptions options = recipe.fsdp;
  const DeviceMesh data = expert_data_parallel_mesh(expert_mesh, dims);
  // Split the local experts when there are enough for every rank, else dim 1 of each weight (the
  // hidden size of w1 and w3, the model dim of w2).
  const bool split_experts = config.experts / dims.ep >= dims.efsdp();
  options.shard_placement_fn = [split_experts](const std::string&, const at::Tensor&) -> std::optional<Placement> {
    return split_experts ? Shard(0) : Shard(1);
  };
  options.mixed_precision.output_dtype.reset();
  const auto stages = llama_layer_stages(dims, recipe, config.llama.layers);
  for (auto& [fqn, experts] : nn::match_modules(model, "layers.*.mlp.experts")) {
    FSDPModule unit = fully_shard(*experts, data, recipe.unit_fsdp(fqn, options, layer_stage(stages, fqn)));
    // A rank's expert gradients already sum the losses of its ep group's ranks (the rows came to
    // it); averaging over the efsdp ranks then leaves a factor ep above the mean over the dp x cp
    // ranks (each one's loss a mean over its tokens, as for the dense blocks). The tp ranks' rows,
    // on the other hand, are shares of one data-parallel rank's tokens: summed.
    unit.set_gradient_scaling_factor(static_cast<double>(dims.tp) / static_cast<double>(dims.ep));
  }
}

// One group over the dims of `mesh` named in `dims` whose size is above 1, flattened as `name`
// when there are several; none when there are none.
std::optional<comm::ProcessGroup> group_over(const DeviceMesh& mesh,
                                             std::initializer_list<std::pair<const char*, int64_t>> dims,
                                             const std::string& name) {
  std::vector<std::string> names;
  for (const auto& [dim, size] : dims)
    if (size > 1) names.push_back(dim);
  if (names.empty()) return std::nullopt;
  const DeviceMesh counted = mesh[names];
  return names.size() == 1 ? counted.get_group(0) : counted.flatten(name).get_group(0);
}

// The ranks whose counts balance_experts sums, or none on one rank: the data-parallel, cp and tp
// ranks (they see different tokens) and the pipeline stages. A rank counts its own stages' layers
// only (zeros for the others), so the sum gives every rank every layer's counts: each updates
// every bias alike (the copies of layers it does not run included) and reports every layer.
std::optional<comm::ProcessGroup> balancing_group(const DeviceMesh& mesh, const ParallelDims& dims) {
  return group_over(mesh,
                    {{"pp", dims.pp},
                     {"dp_replicate", dims.dp_replicate},
                     {"dp_shard", dims.dp_shard},
                     {"cp", dims.cp},
                     {"tp", dims.tp}},
                    "balancing");
}

// The step hook: balance_experts with the counts summed over balancing_group, and per layer as
// metrics the busiest expert over the mean and, when they are on, the bias norm, dropped rows and
// auxiliary losses; the worst layer's load on the progress line.
std::function<StepStats()> load_balancing_hook(const std::shared_ptr<Llama>& model, const DeviceMesh& mesh,
                                               const ParallelDims& dims, const Qwen3MoeConfig& config) {
  const double rate = config.load_balance_rate;
  const bool capacity = config.capacity_factor > 0, aux = config.moe_options().has_aux_loss();
  const std::optional<comm::ProcessGroup> data = balancing_group(mesh, dims);
  std::weak_ptr<Llama> weak = model;  // the parts own the model; the hook must not keep it alive
  return [weak, data, rate, capacity, aux]() {
    const auto model = weak.lock();
    HP_CHECK(model != nullptr, "qwen3_moe: the step hook outlived its model");
    const auto loads = nn::balance_experts(*model, rate, [&](at::Tensor& counts) {
      if (data) data->all_reduce(counts);
    });
    StepStats stats;
    double worst = 0.0;
    for (const nn::ExpertLoad& load : loads) {
      // "layers.3.mlp.router" -> "moe.layers.3"
      const std::string layer = "moe." + load.fqn.substr(0, load.fqn.rfind(".mlp.router"));
      stats.values.emplace_back(layer + ".max_load", load.max_over_mean);
      if (rate > 0) stats.values.emplace_back(layer + ".bias_norm", load.bias_norm);
      if (capacity) stats.values.emplace_back(layer + ".dropped", load.dropped);
      if (aux) stats.values.emplace_back(layer + ".aux_loss", load.aux_loss);
      worst = std::max(worst, load.max_over_mean);
    }
    std::ostringstream summary;
    summary << std::fixed << std::setprecision(2) << "moe max/mean " << worst;
    stats.summary = summary.str();
    return stats;
  };
}

// Each cp and tp rank runs a layer on its share of every sequence's positions: the auxiliary
// losses' statistics are summed over the (cp, tp) ranks, so every one of them computes the losses
// of its data-parallel rank's whole sequences. The sum's backward passes the gradient through
// (Megatron's reduce from the tensor-parallel region), each rank's tokens receiving their part,
// times cp: the recipe averages gradients over the cp ranks like data-parallel ranks (each one's
// loss is the mean over its share of the tokens) but sums them over the tp ranks (the routers'
// units scale by tp), while the losses count once for the sequences the cp ranks share.
void split_tokens_over_sequence_shards(Llama& model, const DeviceMesh& mesh, const ParallelDims& dims) {
  const std::optional<comm::ProcessGroup> shards =
      group_over(mesh, {{"cp", dims.cp}, {"tp", dims.tp}}, "sequence_shards");
  if (!shards) return;
  const comm::ProcessGroup group = *shards;
  const double cp = static_cast<double>(dims.cp);
  const nn::TokenSplit split{dims.cp * dims.tp, [group, cp](const at::Tensor& x) {
                               return record_backward("SumOverTokenShards", x, group.all_reduce(x.detach().clone()),
                                                      [cp](const at::Tensor& grad) { return grad * cp; });
                             }};
  for (auto& [fqn, moe] : nn::match_modules(model, "layers.*.mlp")) dynamic_cast<nn::MoE&>(*moe).set_token_split(split);
}

}  // namespace

ModelParts parallelize_qwen3_moe(std::shared_ptr<Llama> model, const DeviceMesh& mesh, const ParallelDims& dims,
                                 const Qwen3MoeConfig& config, const RecipeOptions& options) {
  HP_CHECK(model != nullptr, "parallelize_qwen3_moe: no model");
  validate_qwen3_moe_dims(dims, config);
  if (dims.dp() * dims.cp * dims.tp > 1 || dims.ep > 1) {
    const DeviceMesh expert_mesh = build_expert_mesh(mesh.world(), dims, mesh.device_type());
    if (dims.ep > 1) parallelize_module(*model, expert_mesh["ep"], {{"layers.*.mlp", ExpertParallel()}});
    shard_experts(*model, expert_mesh, dims, config, options);
  }
  // Each tp rank routes its own tokens: the routers are data-parallel over the tp ranks too. The
  // unit is the whole MoE (its experts are their own units already), whose forward FSDP sees; the
  // router is called through route().
  if (dims.tp > 1) shard_over_data_and_tp(*model, {"layers.*.mlp"}, mesh, dims, options);
  split_tokens_over_sequence_shards(*model, mesh, dims);
  ParallelDims dense = dims;
  dense.ep = 1;  // the experts are placed; the rest is a Llama
  RecipeOptions dense_options = options;
  // A router's gate has one row per expert: with fewer experts than the blocks' shard ranks
  // (dp_shard x cp), split its columns instead.
  dense_options.fsdp.shard_placement_fn =
      split_short_matrices_by_columns(options.fsdp.shard_placement_fn, dims.dp_shard * dims.cp);
  ModelParts parts = parallelize_llama(model, mesh, dense, dense_options, LlamaMlp::kTokenSplit);
  // Muon steps the llama recipe's matrices but the dense MLP's (there is none); the router and the
  // stacked experts step with AdamW.
  auto& hidden = parts.hidden_matrices;
  hidden.erase(std::remove_if(hidden.begin(), hidden.end(),
                              [](const std::string& p) { return p.find(".mlp.") != std::string::npos; }),
               hidden.end());
  parts.other_parameters.insert(parts.other_parameters.end(),
                                {"layers.*.mlp.router.gate.weight", "layers.*.mlp.experts.w1",
                                 "layers.*.mlp.experts.w2", "layers.*.mlp.experts.w3"});
  parts.before_optimizer_step = load_balancing_hook(model, mesh, dims, config);
  parts.forget_step = [weak = std::weak_ptr<Llama>(model)]() {
    if (const auto model = weak.lock()) nn::forget_expert_counts(*model);
  };
  return parts;
}

}  // namespace hp::models
