// Built-in sharding rule families, one file each, and the helpers they share.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "hp/dtensor/sharding_rule.h"

namespace hp::rules {

using Register = std::function<void(const std::string& op, ShardingRule rule)>;

void register_builtin_rules(const Register& add);
void register_matmul_rules(const Register& add);
void register_shape_rules(const Register& add);
void register_like_rules(const Register& add);
void register_nn_rules(const Register& add);
void register_random_rules(const Register& add);
void register_indexed_reduction_rules(const Register& add);

// Families declared in YAML (ops/*.yaml, HP_OPS_YAML_DIR): rule factories and the loader.
enum class Linearity { kNone, kSumOfPartials, kOnePartial, kUnary };
ShardingRule pointwise_rule(const std::string& op, Linearity linearity);
enum class Reduction { kSum, kMean, kMax, kMin };
ShardingRule reduction_rule(Reduction kind, int dims_arg_index, int keepdim_arg_index);
// Registers the rules declared in every *.yaml file of `dir` (sorted by name).
void register_yaml_rules(const Register& add, const std::string& dir);
// Registers the rules declared in `text`, a rule file's contents (`name` names it in errors).
void register_yaml_text(const Register& add, const std::string& name, const std::string& text);

// ---- helpers ----------------------------------------------------------------------------------

inline Placements replicated(int64_t mesh_ndim) { return Placements(mesh_ndim, Replicate()); }

// A rule whose inputs and outputs all become Replicate (the safe answer for any op).
OpSharding all_replicated(const OpCall& call, size_t outputs = 1);

// Dims of a tensor of rank `ndim` named by an int[] argument (negative dims normalized); an
// undefined or empty list means every dim.
std::vector<int64_t> dims_arg(const c10::IValue& value, int64_t ndim);

// True when the splits of `dim` up to and including `mesh_dim` are all even under `spec`
// (torch.chunk gives equal pieces), independent of the mesh coordinate.
bool evenly_split(const DTensorSpec& spec, int64_t dim, int64_t mesh_dim);

}  // namespace hp::rules
