#include "hp/models/model_parts.h"

#include <algorithm>
#include <optional>
#include <set>
#include <string>

#include "hp/core/error.h"
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

// What `pattern` matches of the unit named `unit`: its name, or the name of the first module it
// lies in that matches ("layers.3" for "layers.*" and "layers.3.mlp.experts"); none.
std::optional<std::string> matched_module(const std::string& pattern, const std::string& unit) {
  if (pattern == "root" || unit == "root") return pattern == unit ? std::optional<std::string>(unit) : std::nullopt;
  // The modules it lies in, outermost first ("layers", "layers.3", "layers.3.mlp"), then the unit.
  for (size_t end = unit.find('.');; end = unit.find('.', end + 1)) {
    if (nn::fqn_matches(pattern, unit.substr(0, end))) return unit.substr(0, end);
    if (end == std::string::npos) return std::nullopt;
  }
}

// The first few of `units`, enough to see how they are named.
std::string some_of(const std::vector<std::string>& units) {
  std::string named;
  const size_t shown = std::min<size_t>(units.size(), 8);
  for (size_t i = 0; i < shown; ++i) named += (i ? ", " : "") + units[i];
  if (shown < units.size()) named += ", ... (" + std::to_string(units.size()) + " units)";
  return named;
}

}  // namespace

bool unit_selected(const std::vector<std::string>& patterns, const std::string& unit) {
  return patterns.empty() || std::any_of(patterns.begin(), patterns.end(), [&](const std::string& pattern) {
           return matched_module(pattern, unit).has_value();
         });
}

void check_offload_units(const std::vector<std::string>& patterns, const std::vector<std::string>& units) {
  const std::set<std::string> names(units.begin(), units.end());
  const bool pipeline = names.count(stage_unit_name(0)) > 0;
  for (const std::string& pattern : patterns) {
    bool selects = false;
    for (const std::string& unit : units) {
      const std::optional<std::string> matched = matched_module(pattern, unit);
      if (!matched) continue;
      selects = true;
      HP_CHECK(names.count(*matched), "memory.offload_units: '", pattern, "' matches ", *matched,
               ", which is not an FSDP unit of this layout (its units: ", some_of(units), ")",
               pipeline ? "; with a pipeline each stage is one unit and its blocks are none" : "");
    }
    HP_CHECK(selects, "memory.offload_units: '", pattern,
             "' selects no FSDP unit of this layout (its units: ", some_of(units), ")");
  }
}

std::string stage_unit_name(int64_t stage) { return "stage." + std::to_string(stage); }

std::vector<std::string> fsdp_unit_names(nn::Module& model, int stages) {
  std::vector<std::string> names;
  for (int s = 0; s < stages; ++s) names.push_back(stage_unit_name(s));  // first: error messages show a few
  for (const auto& [fqn, unit] : named_fsdp_units(model)) names.push_back(fqn.empty() ? "root" : fqn);
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
