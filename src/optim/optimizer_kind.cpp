#include "hp/optim/optimizer_kind.h"

#include <c10/util/Type.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <map>
#include <mutex>

#include "hp/core/error.h"
#include "hp/core/libtorch_version.h"
#include "hp/optim/muon.h"
#include "optim/builtin_kinds.h"

namespace hp {
namespace {

class Registry {
 public:
  static Registry& get() {
    static Registry* registry = new Registry();  // never destroyed: kinds may be asked for during exit
    return *registry;
  }

  void add(std::type_index type, std::shared_ptr<const OptimizerKind> kind) {
    HP_CHECK(kind != nullptr, "register_optimizer_kind: got no kind for ", c10::demangle(type.name()));
    std::lock_guard<std::mutex> lock(mutex_);
    kinds_[type] = std::move(kind);
  }

  const OptimizerKind& find(const torch::optim::OptimizerOptions& options) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = kinds_.find(std::type_index(typeid(options)));
    if (it != kinds_.end()) return *it->second;
    std::string known;
    for (const auto& [type, kind] : kinds_) known += (known.empty() ? "" : ", ") + kind->name();
    HP_FAIL("no optimizer kind is registered for options of type ", c10::demangle(typeid(options).name()),
            " (registered: ", known, "); add one with hp::register_optimizer_kind");
  }

 private:
  Registry() {
    kinds_[typeid(torch::optim::AdamWOptions)] = detail::adamw_kind();
    kinds_[typeid(torch::optim::AdamOptions)] = detail::adam_kind();
    kinds_[typeid(MuonOptions)] = detail::muon_kind();
  }

  std::mutex mutex_;
  std::map<std::type_index, std::shared_ptr<const OptimizerKind>> kinds_;
};

}  // namespace

OptimizerStateMap::key_type optimizer_state_key(const at::Tensor& p) {
#if HP_LIBTORCH_2
  return p.unsafeGetTensorImpl();
#else
  return c10::guts::to_string(p.unsafeGetTensorImpl());
#endif
}

void OptimizerKind::step_group(torch::optim::OptimizerParamGroup& /*group*/, OptimizerStateMap& /*state*/) const {
  HP_FAIL(name(), " cannot step a single parameter group, so it cannot be part of a ChainedOptimizer");
}

void register_optimizer_kind(std::type_index options_type, std::shared_ptr<const OptimizerKind> kind) {
  Registry::get().add(options_type, std::move(kind));
}

const OptimizerKind& optimizer_kind(const torch::optim::OptimizerOptions& options) {
  return Registry::get().find(options);
}

void visit_state(torch::optim::Optimizer& optimizer,
                 const std::function<void(const at::Tensor& param, ParamStateFields& fields)>& fn) {
  for (auto& group : optimizer.param_groups()) {
    const OptimizerKind& kind = optimizer_kind(group.options());
    for (const at::Tensor& p : group.params()) {
      auto& slot = optimizer.state()[optimizer_state_key(p)];
      if (!slot) kind.init_state(group.options(), p, slot);
      ParamStateFields fields = kind.fields(*slot);
      const bool keeps_step = fields.step.has_value();
      fn(p, fields);
      if (keeps_step && fields.step) kind.set_step(*slot, *fields.step);
    }
  }
}

}  // namespace hp
