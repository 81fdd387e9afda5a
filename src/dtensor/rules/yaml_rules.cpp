// Rules declared as data: ops/*.yaml (compiled into the library) and the user's files in
// HP_OPS_YAML_DIR map ATen op names to a rule family and its parameters. Every op named must exist
// in ATen, every key must be known: a typo is an error naming the file and the key, not a silently
// missing rule.
#include <ATen/core/dispatch/Dispatcher.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "dtensor/rules/rules.h"
#include "hp/core/error.h"

namespace hp::rules {
namespace {

const std::map<std::string, Linearity> kLinearities = {{"sum_of_partials", Linearity::kSumOfPartials},
                                                       {"one_partial", Linearity::kOnePartial},
                                                       {"unary_linear", Linearity::kUnary},
                                                       {"nonlinear", Linearity::kNone}};
const std::map<std::string, Reduction> kReductions = {
    {"sum", Reduction::kSum}, {"mean", Reduction::kMean}, {"max", Reduction::kMax}, {"min", Reduction::kMin}};

void check_op_exists(const std::string& file, const std::string& op) {
  const size_t dot = op.find('.', op.find("::"));
  const c10::OperatorName name(op.substr(0, dot), dot == std::string::npos ? "" : op.substr(dot + 1));
  HP_CHECK(c10::Dispatcher::singleton().findOp(name).has_value(), file, ": '", op,
           "' is not an ATen op (write it as aten::name or aten::name.overload)");
}

template <typename Map>
auto lookup(const Map& map, const std::string& key, const std::string& file, const char* what) {
  auto it = map.find(key);
  if (it != map.end()) return it->second;
  std::string valid;
  for (const auto& [k, _] : map) valid += (valid.empty() ? "" : ", ") + k;
  throw Error(file + ": unknown " + what + " '" + key + "'; valid: " + valid);
}

void load_pointwise(const Register& add, const std::string& file, const YAML::Node& node) {
  for (const auto& entry : node) {
    const Linearity linearity = lookup(kLinearities, entry.first.as<std::string>(), file, "pointwise linearity");
    for (const auto& op_node : entry.second) {
      const std::string op = op_node.as<std::string>();
      check_op_exists(file, op);
      add(op, pointwise_rule(op, linearity));
    }
  }
}

void load_reduction(const Register& add, const std::string& file, const YAML::Node& node) {
  for (const auto& entry : node) {
    for (const auto& key : entry) {
      const std::string k = key.first.as<std::string>();
      HP_CHECK(k == "op" || k == "kind" || k == "dims_arg" || k == "keepdim_arg", file, ": unknown reduction key '", k,
               "'; valid: op, kind, dims_arg, keepdim_arg");
    }
    HP_CHECK(entry["op"] && entry["kind"], file, ": every reduction needs 'op' and 'kind'");
    const std::string op = entry["op"].as<std::string>();
    check_op_exists(file, op);
    add(op, reduction_rule(lookup(kReductions, entry["kind"].as<std::string>(), file, "reduction kind"),
                           entry["dims_arg"] ? entry["dims_arg"].as<int>() : -1,
                           entry["keepdim_arg"] ? entry["keepdim_arg"].as<int>() : -1));
  }
}

}  // namespace

void register_yaml_text(const Register& add, const std::string& name, const std::string& text) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw Error(name + ": not valid YAML: " + e.what());
  }
  for (const auto& family : root) {
    const std::string kind = family.first.as<std::string>();
    if (kind == "pointwise")
      load_pointwise(add, name, family.second);
    else if (kind == "reduction")
      load_reduction(add, name, family.second);
    else
      throw Error(name + ": unknown rule family '" + kind + "'; valid: pointwise, reduction");
  }
}

void register_yaml_rules(const Register& add, const std::string& dir) {
  namespace fs = std::filesystem;
  HP_CHECK(fs::is_directory(dir), "sharding rules: '", dir, "' is not a directory of *.yaml rule files");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".yaml") files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  for (const fs::path& path : files) {
    std::ifstream in(path);
    HP_CHECK(in, "sharding rules: cannot read ", path.string());
    std::stringstream text;
    text << in.rdbuf();
    register_yaml_text(add, path.string(), text.str());
  }
}

}  // namespace hp::rules
