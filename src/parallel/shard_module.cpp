#include "hp/parallel/shard_module.h"

#include <ATen/ATen.h>

#include "hp/core/error.h"
#include "hp/dtensor/dtensor.h"
#include "parallel/layout.h"

namespace hp {
namespace {

using parallel::normalized;

void check_placements(const std::string& what, const Placements& placements, const DeviceMesh& mesh, int64_t ndim) {
  HP_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), "shard_module: ", what, " has ", placements.size(),
           " placements but the mesh ", mesh.str(), " has ", mesh.ndim(), " dims");
  for (const Placement& p : placements) {
    HP_CHECK(!p.is_partial(), "shard_module: ", what, ": Partial is not a placement a plan can ask for");
    if (p.is_shard())
      HP_CHECK(p.dim() >= -ndim && p.dim() < ndim, "shard_module: ", what, " has ", ndim, " dims; ", p.str(),
               " is out of range");
  }
}

std::vector<std::pair<std::string, nn::Module*>> matched_modules(nn::Module& model, const std::string& pattern,
                                                                 const char* plan_name) {
  auto matched = nn::match_modules(model, pattern);
  HP_CHECK(!matched.empty(), "shard_module: the ", plan_name, " pattern '", pattern, "' matches no module");
  return matched;
}

}  // namespace

void shard_module(nn::Module& model, const DeviceMesh& mesh, const ShardingPlan& plan) {
  // Check everything first, so a bad plan changes nothing.
  std::vector<bool> used(plan.plan.size(), false);
  struct Placed {
    nn::Module* module;
    std::string name, fqn;
    Placements placements;
  };
  std::vector<Placed> params;
  for (auto& [prefix, module] : model.named_modules_fqn()) {
    for (const auto& item : module->named_parameters(/*recurse=*/false)) {
      const std::string fqn = prefix.empty() ? item.key() : prefix + "." + item.key();
      Placements placements(mesh.ndim(), Replicate());
      for (size_t i = 0; i < plan.plan.size(); ++i) {
        if (!nn::fqn_matches(plan.plan[i].first, fqn)) continue;
        check_placements("parameter " + fqn, plan.plan[i].second, mesh, item.value().dim());
        placements = plan.plan[i].second;
        used[i] = true;
        break;
      }
      params.push_back({module, item.key(), fqn, placements});
    }
  }
  for (size_t i = 0; i < plan.plan.size(); ++i)
    HP_CHECK(used[i], "shard_module: the parameter pattern '", plan.plan[i].first, "' matches no parameter");
  std::vector<std::pair<nn::Module*, std::vector<std::optional<Placements>>>> inputs;
  for (const auto& [pattern, layouts] : plan.input_plan)
    for (auto& [fqn, module] : matched_modules(model, pattern, "input_plan")) inputs.emplace_back(module, layouts);
  std::vector<std::pair<nn::Module*, Placements>> outputs;
  for (const auto& [pattern, placements] : plan.output_plan)
    for (auto& [fqn, module] : matched_modules(model, pattern, "output_plan")) outputs.emplace_back(module, placements);

  for (const Placed& p : params) parallel::distribute_parameter(*p.module, p.name, mesh, p.placements, p.fqn);
  for (auto& [module, layouts] : inputs) {
    module->register_forward_pre_hook([mesh, layouts = layouts](nn::Module& m, nn::Inputs& in) {
      HP_CHECK(in.size() == layouts.size(), "shard_module: the input_plan of ", m.name(), " describes ", layouts.size(),
               " inputs but it got ", in.size());
      for (size_t i = 0; i < in.size(); ++i) {
        if (!layouts[i]) continue;
        check_placements("input " + std::to_string(i) + " of " + m.name(), *layouts[i], mesh, in[i].dim());
        const Placements want = normalized(*layouts[i], in[i].dim());
        in[i] = is_dtensor(in[i]) ? parallel::lay_out(in[i], want, /*use_local=*/false)
                                  : distribute_tensor(in[i], mesh, want);
      }
    });
  }
  for (auto& [module, placements] : outputs) {
    module->register_forward_hook([placements = placements](nn::Module& m, const nn::Inputs&, at::Tensor& out) {
      HP_CHECK(is_dtensor(out), "shard_module: the output_plan of ", m.name(),
               " applies to DTensor outputs; this module returned a plain tensor");
      out = parallel::lay_out(out, placements, /*use_local=*/false);
    });
  }
}

}  // namespace hp
