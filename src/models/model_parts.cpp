#include "hp/models/model_parts.h"

#include <algorithm>
#include <set>
#include <string>

#include "hp/nn/init.h"
#include "hp/parallel/fsdp.h"

namespace hp::models {
namespace {

// Calls fn(fqn, parameter) for every parameter of `modules`, in order.
template <typename Fn>
void for_each_parameter(const std::vector<std::shared_ptr<nn::Module>>& modules, const Fn& fn) {
  for (const auto& module : modules)
    for (const auto& item : module->named_parameters()) fn(item.key(), item.value());
}

// The parameters of `parts` that are (or are not) copies, in order.
std::vector<at::Tensor> parameters_where(const ModelParts& parts, bool copy) {
  std::vector<at::Tensor> out;
  for_each_parameter(parts.modules, [&](const std::string& fqn, const at::Tensor& p) {
    if (parts.copies.count(fqn) == (copy ? 1u : 0u)) out.push_back(p);
  });
  return out;
}

}  // namespace

bool unit_selected(const std::vector<std::string>& patterns, const std::string& unit) {
  if (patterns.empty()) return true;
  return std::any_of(patterns.begin(), patterns.end(), [&](const std::string& pattern) {
    if (pattern == "root" || unit == "root") return pattern == unit;
    // The unit's name and each module it lies in: "layers", "layers.3", "layers.3.mlp", ...
    for (size_t end = unit.find('.');; end = unit.find('.', end + 1)) {
      if (nn::fqn_matches(pattern, unit.substr(0, end))) return true;
      if (end == std::string::npos) return false;
    }
  });
}

std::vector<std::string> fsdp_unit_names(nn::Module& model, int stages) {
  std::vector<std::string> names;
  for (const auto& [fqn, unit] : named_fsdp_units(model)) names.push_back(fqn.empty() ? "root" : fqn);
  for (int s = 0; s < stages; ++s) names.push_back("stage." + std::to_string(s));
  return names;
}

void ModelParts::init_parameters(uint64_t seed, c10::Device device) const {
  std::set<std::string> mine;
  for_each_parameter(modules, [&](const std::string& fqn, const at::Tensor&) { mine.insert(fqn); });
  nn::init_parameters(
      *model, seed, [&](const std::string& fqn) { return mine.count(fqn) > 0; }, device);
}

std::vector<at::Tensor> ModelParts::parameters() const {
  std::vector<at::Tensor> out;
  for_each_parameter(modules, [&](const std::string&, const at::Tensor& p) { out.push_back(p); });
  return out;
}

std::vector<at::Tensor> ModelParts::counted_parameters() const { return parameters_where(*this, false); }

std::vector<at::Tensor> ModelParts::copied_parameters() const { return parameters_where(*this, true); }

std::vector<std::pair<std::string, at::Tensor>> ModelParts::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for_each_parameter(modules, [&](const std::string& fqn, const at::Tensor& p) { out.emplace_back(fqn, p); });
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ModelParts::named_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& module : modules) {
    for (const auto& item : module->named_parameters()) out.emplace_back(item.key(), item.value());
    for (const auto& item : module->named_buffers()) out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace hp::models
