#include "dtensor/rules/rules.h"

#include <cstdlib>

#include "hp_builtin_ops.h"

namespace hp::rules {

void register_builtin_rules(const Register& add) {
  // Families declared as data first: the library's own YAML, then the user's (which may override).
  for (const BuiltinOps& file : kBuiltinOps) register_yaml_text(add, file.name, file.text);
  if (const char* user = std::getenv("HP_OPS_YAML_DIR"); user != nullptr && *user != '\0')
    register_yaml_rules(add, user);
  register_matmul_rules(add);
  register_shape_rules(add);
  register_like_rules(add);
  register_nn_rules(add);
  register_random_rules(add);
  register_indexed_reduction_rules(add);
}

OpSharding all_replicated(const OpCall& call, size_t outputs) {
  OpSharding s;
  s.inputs.assign(call.inputs.size(), replicated(call.mesh_ndim()));
  s.outputs.assign(outputs, replicated(call.mesh_ndim()));
  return s;
}

std::vector<int64_t> dims_arg(const c10::IValue& value, int64_t ndim) {
  std::vector<int64_t> dims;
  if (value.isIntList())
    dims = value.toIntVector();
  else if (value.isInt())
    dims = {value.toInt()};
  if (dims.empty()) {
    for (int64_t d = 0; d < ndim; ++d) dims.push_back(d);
    return dims;
  }
  for (int64_t& d : dims) d = d < 0 ? d + ndim : d;
  return dims;
}

bool evenly_split(const DTensorSpec& spec, int64_t dim, int64_t mesh_dim) {
  int64_t parts = 1;
  for (int64_t i = 0; i <= mesh_dim; ++i)
    if (spec.placements()[i].is_shard(dim)) parts *= spec.mesh().size(i);
  return spec.shape()[dim] % parts == 0;
}

}  // namespace hp::rules
