#include "hp/models/hf_state.h"

#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hp/core/error.h"
#include "hp/models/llama/hf_names.h"

namespace hp::models {
namespace {

// Our MoE tensors under a layer's "mlp." and their Hugging Face names under the same prefix.
const std::vector<std::pair<std::string, std::string>>& router_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"router.gate.weight", "gate.weight"}, {"router.expert_bias", "gate.e_score_correction_bias"}};
  return names;
}

// Our stacked expert weights and the per-expert projection each one holds.
const std::vector<std::pair<std::string, std::string>>& expert_weights() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}};
  return names;
}

// "<prefix>N.mlp.<rest>" as (N, rest).
std::optional<std::pair<std::string, std::string>> mlp_tensor(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t digits = name.find_first_not_of("0123456789", prefix.size());
  if (digits == std::string::npos || digits == prefix.size() || name.compare(digits, 5, ".mlp.") != 0)
    return std::nullopt;
  return std::make_pair(name.substr(prefix.size(), digits - prefix.size()), name.substr(digits + 5));
}

void put(NamedTensors& tensors, const std::string& name, const at::Tensor& t, const std::string& from) {
  HP_CHECK(tensors.emplace(name, t).second, "hf: '", from, "' maps to '", name, "', which is already taken");
}

}  // namespace

HfPlace hf_place(const std::string& name, at::IntArrayRef shape) {
  if (const auto mlp = mlp_tensor(name, "layers.")) {
    const std::string hf_mlp = "model.layers." + mlp->first + ".mlp.";
    for (const auto& [our, their] : router_names())
      if (mlp->second == our) return {{hf_mlp + their}, false, our == "router.expert_bias"};
    for (const auto& [our, projection] : expert_weights()) {
      if (mlp->second != "experts." + our) continue;
      HP_CHECK(shape.size() == 3, "hf: '", name, "' should be stacked [experts, out, in], got ", shape);
      HfPlace place{{}, true};
      for (int64_t e = 0; e < shape[0]; ++e)
        place.names.push_back(hf_mlp + "experts." + std::to_string(e) + "." + projection + ".weight");
      return place;
    }
  }
  const std::string hf_name = llama_to_hf_name(name);
  HP_CHECK(!hf_name.empty(), "hf: '", name, "' has no Hugging Face name");
  return {{hf_name}, false};
}

NamedTensors to_hf_tensors(const NamedTensors& ours) {
  NamedTensors hf;
  for (const auto& [name, t] : ours) {
    const HfPlace place = hf_place(name, t.sizes());
    for (size_t i = 0; i < place.names.size(); ++i)
      put(hf, place.names[i], place.stacked ? t[static_cast<int64_t>(i)] : t, name);
  }
  return hf;
}

NamedTensors from_hf_tensors(const NamedTensors& hf) {
  NamedTensors ours;
  std::map<std::string, std::map<int64_t, at::Tensor>> stacks;  // our stacked name -> expert -> weight
  for (const auto& [name, t] : hf) {
    if (const auto mlp = mlp_tensor(name, "model.layers.")) {
      const std::string our_mlp = "layers." + mlp->first + ".mlp.";
      bool done = false;
      for (const auto& [our, their] : router_names())
        if (mlp->second == their) put(ours, our_mlp + our, t, name), done = true;
      // "experts.E.<projection>.weight"
      const std::string& rest = mlp->second;
      const size_t digits = rest.find_first_not_of("0123456789", 8);
      if (!done && rest.rfind("experts.", 0) == 0 && digits != std::string::npos && digits > 8) {
        for (const auto& [our, projection] : expert_weights())
          if (rest.compare(digits, std::string::npos, "." + projection + ".weight") == 0) {
            const std::string number = rest.substr(8, digits - 8);
            HP_CHECK(number.size() <= 9 && number == std::to_string(std::stoll(number)), "hf: '", name,
                     "' numbers its expert oddly");
            HP_CHECK(stacks[our_mlp + "experts." + our].emplace(std::stoll(number), t).second, "hf: '", name,
                     "' twice");
            done = true;
          }
      }
      if (done) continue;
    }
    const std::string our_name = llama_from_hf_name(name);
    HP_CHECK(!our_name.empty(), "hf: the Hugging Face tensor '", name, "' has no counterpart here");
    put(ours, our_name, t, name);
  }
  for (const auto& [name, experts] : stacks) {
    std::vector<at::Tensor> weights;
    for (const auto& [expert, weight] : experts) {
      HP_CHECK(expert == static_cast<int64_t>(weights.size()), "hf: '", name, "' lacks expert ", weights.size(),
               " (its experts must be numbered 0, 1, ... without gaps)");
      HP_CHECK(weight.sizes() == experts.begin()->second.sizes() && weight.dtype() == experts.begin()->second.dtype(),
               "hf: the experts of '", name, "' differ in shape or dtype (expert ", expert, ": ", weight.sizes(), ")");
      weights.push_back(weight);
    }
    put(ours, name, at::stack(weights), name);
  }
  return ours;
}

}  // namespace hp::models
