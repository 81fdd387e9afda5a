// The table from ATen op names to sharding rules. Built-in families register themselves from
// register_builtin_rules() (called once, before the first lookup); users add theirs any time.
#include <map>
#include <mutex>

#include "dtensor/rules/rules.h"
#include "hp/dtensor/sharding_rule.h"

namespace hp {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, ShardingRule> rules;
};

Registry& registry() {
  static Registry* r = [] {
    auto* created = new Registry();  // leaked on purpose: rules may be looked up during exit
    rules::register_builtin_rules([created](const std::string& op, ShardingRule rule) {
      created->rules[op] = std::move(rule);
    });
    return created;
  }();
  return *r;
}

}  // namespace

void register_sharding_rule(const std::string& op, ShardingRule rule) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.rules[op] = std::move(rule);
}

const ShardingRule* find_sharding_rule(const std::string& op) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.rules.find(op);
  return it == r.rules.end() ? nullptr : &it->second;  // map nodes are stable
}

}  // namespace hp
