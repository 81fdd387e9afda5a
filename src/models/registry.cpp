#include "hp/models/registry.h"

#include <map>
#include <mutex>

#include "hp/models/llama/spec.h"
#include "hp/models/model_spec.h"
#include "hp/models/qwen3_moe/spec.h"

namespace hp::models {
namespace {

// hp-train's default qwen3_moe: byte-level, 8 experts of which each token runs 2.
Qwen3MoeConfig tiny_qwen3_moe() {
  Qwen3MoeConfig c;
  c.llama = {256, 128, 2, 4, 2, /*ffn_hidden (unused)=*/384, 128};
  c.llama.qk_norm = true;
  c.experts = 8;
  c.top_k = 2;
  c.expert_hidden = 128;
  return c;
}

class Families {
 public:
  static Families& get() {
    static Families* families = new Families();  // never destroyed: configs may be copied during exit
    return *families;
  }

  void add(const std::string& name, ModelSpecFactory make) {
    HP_CHECK(!name.empty() && make, "register_model_family: needs a name and a factory");
    std::lock_guard<std::mutex> lock(mutex_);
    factories_[name] = std::move(make);
  }

  std::unique_ptr<ModelSpec> make(const std::string& name) {
    ModelSpecFactory factory;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = factories_.find(name);
      if (it != factories_.end()) factory = it->second;
    }
    HP_CHECK(factory, "model.family '", name, "' is unknown (available: ", join(names()), ")");
    std::unique_ptr<ModelSpec> spec = factory();
    HP_CHECK(spec != nullptr && spec->family() == name, "model family '", name, "': its factory made ",
             spec ? "a spec of family '" + spec->family() + "'" : std::string("no spec"));
    return spec;
  }

  std::vector<std::string> names() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> out;
    for (const auto& [name, factory] : factories_) out.push_back(name);
    return out;
  }

 private:
  // The families built in: one line each, with the model hp-train trains when a config sets no
  // model.* key.
  Families() {
    factories_["llama"] = [] { return std::make_unique<LlamaSpec>(LlamaConfig{256, 128, 2, 4, 2, 384, 128}); };
    factories_["qwen3_moe"] = [] { return std::make_unique<Qwen3MoeSpec>(tiny_qwen3_moe()); };
  }

  static std::string join(const std::vector<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
  }

  std::mutex mutex_;
  std::map<std::string, ModelSpecFactory> factories_;
};

}  // namespace

ModelConfig::ModelConfig() : ModelConfig("llama") {}
ModelConfig::ModelConfig(const std::string& family) : spec_(Families::get().make(family)) {}
ModelConfig::ModelConfig(std::unique_ptr<ModelSpec> spec) : spec_(std::move(spec)) {
  HP_CHECK(spec_ != nullptr, "ModelConfig: no spec");
}
ModelConfig::ModelConfig(const ModelConfig& other) : spec_(other.spec_ ? other.spec_->clone() : nullptr) {}
ModelConfig& ModelConfig::operator=(const ModelConfig& other) {
  if (this != &other) spec_ = other.spec_ ? other.spec_->clone() : nullptr;
  return *this;
}
ModelConfig::ModelConfig(ModelConfig&&) noexcept = default;
ModelConfig& ModelConfig::operator=(ModelConfig&&) noexcept = default;
ModelConfig::~ModelConfig() = default;

void register_model_family(const std::string& name, ModelSpecFactory make_default) {
  Families::get().add(name, std::move(make_default));
}

std::vector<std::string> model_families() { return Families::get().names(); }

}  // namespace hp::models
