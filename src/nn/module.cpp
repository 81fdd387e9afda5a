#include "hp/nn/module.h"

#include <ATen/ATen.h>

#include <sstream>

#include "hp/core/error.h"
#include "hp/core/memory_timeline.h"

namespace hp::nn {

std::string Init::str() const {
  std::ostringstream out;
  switch (kind) {
    case Kind::kNormal:
      out << "normal(" << a << ", " << b << ")";
      break;
    case Kind::kUniform:
      out << "uniform(" << a << ", " << b << ")";
      break;
    case Kind::kConstant:
      out << "constant(" << a << ")";
      break;
  }
  return out.str();
}

namespace {
thread_local bool meta_parameters_allowed = false;
}  // namespace

MetaParametersAllowed::MetaParametersAllowed() : outer_(meta_parameters_allowed) { meta_parameters_allowed = true; }
MetaParametersAllowed::~MetaParametersAllowed() { meta_parameters_allowed = outer_; }

Module::Module(std::string type_name) : torch::nn::Module(std::move(type_name)) {}

at::Tensor Module::call(Inputs inputs) {
  check_initialized();
  const MemoryLabel running(MemoryLabel::kModule, this);  // what it allocates, for a dry run's report
  if (!call_wrapper_) return call_unwrapped(std::move(inputs));
  return call_wrapper_(*this, std::move(inputs), [this](Inputs in) { return call_unwrapped(std::move(in)); });
}

at::Tensor Module::call_unwrapped(Inputs inputs) {
  for (const auto& [id, hook] : pre_hooks_) hook(*this, inputs);
  at::Tensor output = forward_override_ ? forward_override_(*this, inputs) : forward_inputs(inputs);
  for (const auto& [id, hook] : post_hooks_) hook(*this, inputs, output);
  return output;
}

at::Tensor Module::forward(const at::Tensor&) {
  HP_FAIL(name(), " has no one-input forward; override forward(x) or forward_inputs(inputs)");
}

at::Tensor Module::forward_inputs(const Inputs& inputs) {
  HP_CHECK(inputs.size() == 1, name(), " takes one input, got ", inputs.size());
  return forward(inputs[0]);
}

HookHandle Module::register_forward_pre_hook(PreHook hook) {
  pre_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return {next_hook_id_++};
}

HookHandle Module::register_forward_hook(PostHook hook) {
  post_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return {next_hook_id_++};
}

void Module::set_call_wrapper(CallWrapper wrapper) {
  HP_CHECK(!call_wrapper_, name(), " already has a call wrapper (e.g. it is already checkpointed)");
  call_wrapper_ = std::move(wrapper);
}

void Module::set_forward_override(ForwardOverride forward) {
  HP_CHECK(!forward_override_, name(), " already computes its forward another way (a plan set it)");
  forward_override_ = std::move(forward);
}

void Module::replace_forward_override(ForwardOverride forward) {
  HP_CHECK(forward_override_, name(), " has no forward override to replace");
  forward_override_ = std::move(forward);
}

void Module::remove_hook(HookHandle handle) {
  auto drop = [&](auto& hooks) {
    const auto before = hooks.size();
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [&](const auto& h) { return h.first == handle.id; }),
                hooks.end());
    return hooks.size() != before;
  };
  HP_CHECK(drop(pre_hooks_) || drop(post_hooks_), name(), ": no hook with id ", handle.id);
}

const at::Tensor& Module::param(const std::string& name) const {
  const at::Tensor* found = parameters_.find(name);
  HP_CHECK(found != nullptr, this->name(), " has no parameter '", name, "'");
  return *found;
}

void Module::set_param(const std::string& name, at::Tensor value) {
  at::Tensor* slot = parameters_.find(name);
  HP_CHECK(slot != nullptr, this->name(), " has no parameter '", name, "'");
  HP_CHECK(value.sizes() == slot->sizes(), this->name(), ".", name, ": the replacement has shape ", value.sizes(),
           " but the parameter has shape ", slot->sizes());
  *slot = std::move(value);
}

const Init& Module::param_init(const std::string& name) const {
  for (const auto& [n, init] : inits_)
    if (n == name) return init;
  HP_FAIL(this->name(), " has no parameter '", name, "'");
}

void Module::set_param_init(const std::string& name, Init init) {
  for (auto& [n, existing] : inits_)
    if (n == name) {
      existing = init;
      return;
    }
  HP_FAIL(this->name(), " has no parameter '", name, "'");
}

void Module::add_param(const std::string& name, std::vector<int64_t> shape, Init init, bool requires_grad) {
  register_parameter(name, at::empty(shape, at::TensorOptions().device(at::kMeta)), requires_grad);
  inits_.emplace_back(name, init);
}

void Module::check_initialized() const {
  if (meta_parameters_allowed) return;
  for (const auto& item : parameters_) {
    const at::Tensor& p = item.value();
    // A DTensor reports the device of its local piece, so this also catches unallocated shards.
    HP_CHECK(!p.defined() || !p.is_meta(), name(), ".", item.key(),
             " has no storage yet; call hp::nn::init_parameters(model, seed) before running the model");
  }
}

std::vector<std::pair<std::string, Module*>> Module::named_modules_fqn() {
  std::vector<std::pair<std::string, Module*>> out = {{"", this}};
  for (const auto& child : named_children()) {
    auto* hp_child = dynamic_cast<Module*>(child.value().get());
    if (hp_child == nullptr) continue;  // plain torch modules cannot carry plans
    for (auto& [fqn, m] : hp_child->named_modules_fqn())
      out.emplace_back(fqn.empty() ? child.key() : child.key() + "." + fqn, m);
  }
  return out;
}

namespace {

std::vector<std::string> split_fqn(const std::string& fqn) {
  std::vector<std::string> parts;
  if (fqn.empty()) return parts;
  std::string part;
  std::istringstream in(fqn);
  while (std::getline(in, part, '.')) parts.push_back(part);
  return parts;
}

bool matches(const std::vector<std::string>& pattern, const std::vector<std::string>& fqn) {
  if (pattern.size() != fqn.size()) return false;
  for (size_t i = 0; i < fqn.size(); ++i)
    if (pattern[i] != "*" && pattern[i] != fqn[i]) return false;
  return true;
}

}  // namespace

Module& find_module(Module& root, const std::string& fqn) {
  Module* at = &root;
  std::string path;
  for (const std::string& part : split_fqn(fqn)) {
    Module* next = nullptr;
    for (const auto& child : at->named_children())
      if (child.key() == part) next = dynamic_cast<Module*>(child.value().get());
    HP_CHECK(next != nullptr, "no hp::nn module '", part, "' under '", path, "' (looking up '", fqn, "')");
    path += (path.empty() ? "" : ".") + part;
    at = next;
  }
  return *at;
}

bool fqn_matches(const std::string& pattern, const std::string& fqn) {
  return matches(split_fqn(pattern), split_fqn(fqn));
}

std::vector<std::pair<std::string, Module*>> match_modules(Module& root, const std::string& pattern) {
  const auto wanted = split_fqn(pattern);
  std::vector<std::pair<std::string, Module*>> out;
  for (auto& [fqn, m] : root.named_modules_fqn())
    if (matches(wanted, split_fqn(fqn))) out.emplace_back(fqn, m);
  return out;
}

void replace_parameter(Module& root, const std::string& fqn, at::Tensor value) {
  const auto dot = fqn.rfind('.');
  Module& owner = find_module(root, dot == std::string::npos ? "" : fqn.substr(0, dot));
  try {
    owner.set_param(dot == std::string::npos ? fqn : fqn.substr(dot + 1), std::move(value));
  } catch (const Error& e) {  // set_param knows the module's type, not where it sits in the model
    HP_FAIL("replace_parameter: ", fqn, ": ", e.what());
  }
}

}  // namespace hp::nn
