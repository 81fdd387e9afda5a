// hp-train's model.from_hf: a run that does not resume starts from a Hugging Face model's weights.
#pragma once

#include <string>

#include "hp/models/model_parts.h"

namespace hp::train::detail {

// Fills every parameter and buffer of `parts` from the safetensors files in `dir`, each rank
// reading only the bytes of its own pieces (an expert-parallel rank only its experts' slices, a
// pipeline rank only its stages). Training state the files lack (the expert bias) stays as it is.
// Not collective. Throws hp::Error naming the file, tensor or shape that does not fit.
void load_hf_weights(const models::ModelParts& parts, const std::string& dir);

}  // namespace hp::train::detail
