#include "train/hf_weights.h"

#include <map>
#include <set>

#include "hp/dcp/hf.h"
#include "hp/models/hf_state.h"

namespace hp::train::detail {

void load_hf_weights(const models::ModelParts& parts, const std::string& dir) {
  const std::set<std::string> in_files = dcp::hf_tensor_names(dir);
  dcp::StateDict state;
  std::map<std::string, models::HfPlace> places;
  for (const auto& [fqn, tensor] : parts.named_tensors()) {
    models::HfPlace place = models::hf_place(fqn, tensor.sizes());
    if (place.optional && !in_files.count(place.names.at(0))) continue;
    state.tensors[fqn] = tensor;
    places.emplace(fqn, std::move(place));
  }
  dcp::load_hf(state, dir, [&places](const std::string& fqn) -> dcp::HfName {
    const models::HfPlace& place = places.at(fqn);
    return place.stacked ? dcp::HfName::stacked(place.names) : dcp::HfName(place.names.at(0));
  });
}

}  // namespace hp::train::detail
