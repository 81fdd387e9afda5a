#include "train/hf_weights.h"

#include "hp/dcp/hf.h"
#include "hp/models/hf_state.h"

namespace hp::train::detail {

void load_hf_weights(const models::ModelParts& parts, const std::string& dir) {
  dcp::StateDict state;
  for (const auto& [fqn, tensor] : parts.named_tensors()) state.tensors[fqn] = tensor;
  dcp::load_hf(state, dir, [&state](const std::string& fqn) {
    const models::HfPlace place = models::hf_place(fqn, state.tensors.at(fqn).sizes());
    dcp::HfName name(place.names, place.stacked);
    name.optional = place.optional;
    return name;
  });
}

}  // namespace hp::train::detail
