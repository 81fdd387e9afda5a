// The table from ATen op names to sharding rules. Built-in families register themselves from
// register_builtin_rules() (called once, before the first lookup); users add theirs any time.
#include <map>
#include <mutex>

#include "dtensor/rules/rules.h"
#include "hp/core/error.h"
#include "hp/dtensor/sharding_rule.h"

namespace hp {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, ShardingRule> rules;
  std::map<std::string, int64_t> lookups;  // rule -> times a decision needed it (cache misses)
  std::vector<std::string> builtin;        // the rules the library itself registered
};

Registry& registry() {
  static Registry* r = [] {
    auto* created = new Registry();  // leaked on purpose: rules may be looked up during exit
    rules::register_builtin_rules(
        [created](const std::string& op, ShardingRule rule) { created->rules[op] = std::move(rule); });
    for (const auto& [name, _] : created->rules) created->builtin.push_back(name);
    return created;
  }();
  return *r;
}

}  // namespace

void load_sharding_rules(const std::string& dir) {
  rules::register_yaml_rules(
      [](const std::string& op, ShardingRule rule) { register_sharding_rule(op, std::move(rule)); }, dir);
}

const std::vector<int64_t>& OpCall::output_shape(size_t i) const {
  HP_CHECK(i < output_shapes.size(), "DTensor: the sharding rule for ", op, " needs the shape of output ", i,
           ", which could not be inferred (no meta kernel); the rule must compute it");
  return output_shapes[i];
}

void register_sharding_rule(const std::string& op, ShardingRule rule) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.rules[op] = std::move(rule);
}

const ShardingRule* find_sharding_rule(const std::string& op) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.rules.find(op);
  if (it == r.rules.end()) return nullptr;
  ++r.lookups[op];
  return &it->second;  // map nodes are stable
}

std::map<std::string, int64_t> sharding_rule_lookups() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.lookups;
}

std::vector<std::string> registered_sharding_rules(bool builtin_only) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (builtin_only) return r.builtin;
  std::vector<std::string> names;
  for (const auto& [name, _] : r.rules) names.push_back(name);
  return names;
}

}  // namespace hp
