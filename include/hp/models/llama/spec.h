// The llama family as hp-train sees it: model.* keys are LlamaConfig's fields, the recipe is
// parallelize_llama.
#pragma once

#include <memory>
#include <string>

#include "hp/models/llama/model.h"
#include "hp/models/model_spec.h"

namespace hp::models {

// LlamaConfig's model.* keys, pointing into `config`; without `with_mlp`, all but ffn_hidden (for
// a family that replaces the dense MLP).
ConfigFields llama_config_fields(LlamaConfig& config, bool with_mlp);

class LlamaSpec : public ModelSpecOf<LlamaConfig> {
 public:
  explicit LlamaSpec(LlamaConfig config) : ModelSpecOf(std::move(config)) {}
  std::unique_ptr<ModelSpec> clone() const override { return std::make_unique<LlamaSpec>(config); }
  std::string family() const override { return "llama"; }
  ConfigFields fields() override;
  void validate() const override { config.validate(); }
  void validate_parallel(const ParallelDims& dims, const RecipeOptions& options) const override;
  int64_t vocab() const override { return config.vocab; }
  int64_t max_seq() const override { return config.max_seq; }
  int64_t layers() const override { return config.layers; }
  int64_t parameter_count() const override { return config.parameter_count(); }
  double flops_per_token(int64_t seq) const override { return config.flops_per_token(seq); }
  double activation_bytes_per_token(const ParallelDims& dims) const override;
  std::string describe() const override;
  ModelParts build(const DeviceMesh& mesh, const ParallelDims& dims, const RecipeOptions& options) const override;
};

}  // namespace hp::models
