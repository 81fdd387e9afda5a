// Model families by name: a training config's model.family picks one, and its model.* keys set that
// family's config. Built in: "llama" (Llama / Qwen3 dense). A new family is a folder
// models/<family>/ with a ModelSpec (hp/models/model_spec.h) and one line in src/models/registry.cpp,
// or a register_model_family call from outside the library.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/core/error.h"

namespace hp::models {

class ModelSpec;

// One family's model config, by value (copies are deep). `config->` reaches the ModelSpec (include
// hp/models/model_spec.h), `config.as<LlamaConfig>()` the family's own struct.
class ModelConfig {
 public:
  ModelConfig();  // llama's defaults
  // The family's defaults; an unknown family is an error naming the known ones.
  explicit ModelConfig(const std::string& family);
  explicit ModelConfig(std::unique_ptr<ModelSpec> spec);
  ModelConfig(const ModelConfig& other);
  ModelConfig& operator=(const ModelConfig& other);
  ModelConfig(ModelConfig&&) noexcept;
  ModelConfig& operator=(ModelConfig&&) noexcept;
  ~ModelConfig();

  ModelSpec* operator->() { return spec_.get(); }
  const ModelSpec* operator->() const { return spec_.get(); }
  ModelSpec& operator*() { return *spec_; }
  const ModelSpec& operator*() const { return *spec_; }
  template <typename Config>
  Config& as();  // defined in hp/models/model_spec.h
  template <typename Config>
  const Config& as() const;

 private:
  std::unique_ptr<ModelSpec> spec_;
};

using ModelSpecFactory = std::function<std::unique_ptr<ModelSpec>()>;

// Adds (or replaces) the family `name`; `make_default` gives a spec with the family's defaults.
void register_model_family(const std::string& name, ModelSpecFactory make_default);
std::vector<std::string> model_families();  // sorted

}  // namespace hp::models
