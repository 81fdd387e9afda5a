// The qwen3_moe family as hp-train sees it: model.* keys are the Llama keys but ffn_hidden, plus
// experts, top_k, expert_hidden and norm_topk_prob; the recipe is parallelize_qwen3_moe.
#pragma once

#include <memory>
#include <string>

#include "hp/models/model_spec.h"
#include "hp/models/qwen3_moe/model.h"

namespace hp::models {

class Qwen3MoeSpec : public ModelSpecOf<Qwen3MoeConfig> {
 public:
  explicit Qwen3MoeSpec(Qwen3MoeConfig config) : ModelSpecOf(std::move(config)) {}
  std::unique_ptr<ModelSpec> clone() const override { return std::make_unique<Qwen3MoeSpec>(config); }
  std::string family() const override { return "qwen3_moe"; }
  ConfigFields fields() override;
  void validate() const override { config.validate(); }
  void validate_parallel(const ParallelDims& dims, const RecipeOptions& options) const override;
  int64_t vocab() const override { return config.llama.vocab; }
  int64_t max_seq() const override { return config.llama.max_seq; }
  int64_t layers() const override { return config.llama.layers; }
  int64_t parameter_count() const override { return config.parameter_count(); }
  double flops_per_token(int64_t seq) const override { return config.flops_per_token(seq); }
  double activation_bytes_per_token(const ParallelDims& dims) const override;
  std::string describe() const override;
  ModelParts build(const DeviceMesh& mesh, const ParallelDims& dims, const RecipeOptions& options) const override;
};

}  // namespace hp::models
