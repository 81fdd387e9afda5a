// Llama cut into pipeline stages by layer ranges.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "hp/models/llama/model.h"

namespace hp::models {

// Pipeline stages of `model`: stage i runs the next layers_per_stage[i] blocks; the embedding joins
// the first stage and the final norm and head the last (a stage may have no blocks). The stages
// share the model's modules under the model's FQNs ("layers.3.attn.q_proj.weight"), so parameters
// keep their identity and names (init_parameters on the whole model initializes them; plans and
// checkpoints address them as in the whole model).
// With tie_embeddings, the last stage's head uses the embedding too and holds it as "embed" (so
// "embed.weight" in both the first and the last stage): run such stages on different ranks and
// tie them with PipelineOptions::tied = {{"embed.weight", {0, last}}}.
std::vector<std::shared_ptr<nn::Module>> split_llama(Llama& model, const std::vector<int64_t>& layers_per_stage);

}  // namespace hp::models
