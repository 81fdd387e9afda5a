// Sharding rules: how an ATen op maps input placements to output placements.
//
// A rule is a pure function of the call's DTensor input specs, its other arguments and its output
// shapes (no process group inside). It returns the placements each DTensor input must have (the
// dispatcher redistributes inputs that differ) and the placements of each tensor output. Rules are
// registered per op name ("aten::add.Tensor") in C++; see docs/dtensor.md for the families.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hp/dtensor/spec.h"

namespace hp {

// One call of an op, as a rule sees it.
struct OpCall {
  std::string op;                   // "aten::add.Tensor"
  std::vector<c10::IValue> args;    // all arguments; DTensor arguments are None here
  std::vector<int> dtensor_arg;     // for each DTensor input: its argument index
  std::vector<DTensorSpec> inputs;  // each DTensor input's spec, in argument order (lists flattened)
  // Global shape of each tensor output, from running the op on meta tensors; empty when the op
  // has no meta kernel (then the rule must fill OpSharding::output_shapes).
  std::vector<std::vector<int64_t>> output_shapes;
  const DeviceMesh& mesh() const { return inputs.front().mesh(); }
  // output_shapes[i], or an hp::Error saying the op has no meta kernel to infer it from.
  const std::vector<int64_t>& output_shape(size_t i) const;
  int64_t mesh_ndim() const { return mesh().ndim(); }
};

struct OpSharding {
  std::vector<Placements> inputs;   // required placements of each DTensor input (same order)
  std::vector<Placements> outputs;  // placements of each tensor output
  // Ops whose arguments spell the output's shape (view, expand, ...) must get this rank's local
  // shape instead of the global one: the index of that int[] argument, and of a stride argument
  // to fill in (-1 for none): with the strides a view of input 0 in the local shape has
  // (`strides_view_input`, for _reshape_alias), else with contiguous strides (new allocations).
  int local_shape_arg = -1;
  int local_stride_arg = -1;
  bool strides_view_input = false;
  // Only for ops without a meta kernel: the global shape of each tensor output.
  std::vector<std::vector<int64_t>> output_shapes;
  // For ops whose local result depends on where the piece sits (random fills, vocab-sharded
  // embedding): computes this rank's single result from the local arguments, output 0's spec and
  // the DTensor inputs' specs (as redistributed), instead of running the op.
  using LocalKernel = std::function<c10::IValue(const std::vector<c10::IValue>& local_args, const DTensorSpec& output,
                                                const std::vector<DTensorSpec>& inputs)>;
  LocalKernel local_kernel;
};

using ShardingRule = std::function<OpSharding(const OpCall&)>;

// Registers (or replaces) the rule for `op`, e.g. "aten::gelu" or "aten::add.Tensor".
void register_sharding_rule(const std::string& op, ShardingRule rule);

// Registers the rules declared in every *.yaml file of `dir` (format: the library's ops/*.yaml).
// The library loads its own ops/ directory and then $HP_OPS_YAML_DIR, if set, on first use; call
// this for more. Unknown families, keys or op names are hp::Errors naming the file.
void load_sharding_rules(const std::string& dir);
// nullptr when `op` has no rule.
const ShardingRule* find_sharding_rule(const std::string& op);
// The names of every op with a rule, sorted; with `builtin_only`, those the library itself declared
// (its C++ families, ops/*.yaml and $HP_OPS_YAML_DIR at start-up).
std::vector<std::string> registered_sharding_rules(bool builtin_only = false);
// How often each rule was consulted (decision cache misses) in this process: lets a test prove it
// exercised every rule.
std::map<std::string, int64_t> sharding_rule_lookups();

}  // namespace hp
