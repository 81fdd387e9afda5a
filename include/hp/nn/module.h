// hp::nn::Module: a torch::nn::Module that plans can act on from outside (DESIGN 2.4).
//
// Three things beyond torch::nn::Module:
//  - calling a module (`module(x)`) runs forward pre-hooks (which may replace the inputs), forward,
//    then forward hooks (which may replace the output). Plans redistribute activations there. A
//    plan that must run the whole call again later (activation checkpointing) wraps it instead;
//  - parameters are reachable by fully-qualified name ("layers.0.attn.q_proj.weight") and
//    replaceable in place, so a plan can turn them into DTensors. Module code therefore reads its
//    parameters through param("weight") at each call instead of caching the tensor;
//  - submodules are found by FQN pattern ("layers.*.attn.q_proj", '*' = one name segment).
//
// Parameters are created without storage (on the meta device) together with an initializer;
// hp::nn::init_parameters(model, seed) allocates them, after any plan has sharded them, so each
// rank allocates only its shard (deferred initialization, hp/nn/init.h).
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace hp::nn {

using Inputs = std::vector<at::Tensor>;

// How init_parameters fills a parameter. Values come from a counter-based generator indexed by
// the element's position in the whole parameter, so they do not depend on how it is sharded.
struct Init {
  enum class Kind { kNormal, kUniform, kConstant };
  Kind kind = Kind::kConstant;
  double a = 0.0, b = 0.0;  // normal: mean, std; uniform: low, high; constant: value

  static Init normal(double mean, double std) { return {Kind::kNormal, mean, std}; }
  static Init uniform(double low, double high) { return {Kind::kUniform, low, high}; }
  static Init constant(double value) { return {Kind::kConstant, value, 0.0}; }
  std::string str() const;
};

// Identifies a registered hook for remove_hook.
struct HookHandle {
  int64_t id = -1;
};

// While one lives on this thread, modules run with parameters that have no storage (on the meta
// device), as a dry run does (hp::train::dry_run: shapes and sizes, no values). Otherwise running a
// module whose parameters were never initialized is an error.
class MetaParametersAllowed {
 public:
  MetaParametersAllowed();
  ~MetaParametersAllowed();
  MetaParametersAllowed(const MetaParametersAllowed&) = delete;
  MetaParametersAllowed& operator=(const MetaParametersAllowed&) = delete;

 private:
  bool outer_;
};

class Module : public torch::nn::Module {
 public:
  using PreHook = std::function<void(Module& module, Inputs& inputs)>;
  using PostHook = std::function<void(Module& module, const Inputs& inputs, at::Tensor& output)>;
  // Runs in place of a call: `run(inputs)` performs it (pre-hooks, forward, post-hooks) and may be
  // kept to run it again later.
  using Run = std::function<at::Tensor(Inputs inputs)>;
  using CallWrapper = std::function<at::Tensor(Module& module, Inputs inputs, const Run& run)>;

  explicit Module(std::string type_name);

  // Runs the pre-hooks, forward, then the post-hooks, in registration order.
  at::Tensor call(Inputs inputs);
  at::Tensor operator()(const at::Tensor& x) { return call({x}); }
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& y) { return call({x, y}); }

  HookHandle register_forward_pre_hook(PreHook hook);
  HookHandle register_forward_hook(PostHook hook);
  void remove_hook(HookHandle handle);
  // One wrapper per module; an error if it has one.
  void set_call_wrapper(CallWrapper wrapper);
  bool has_call_wrapper() const { return static_cast<bool>(call_wrapper_); }
  // Computes this module's output from its (hooked) inputs in place of forward: a plan that fuses
  // a layer's communication into its computation (async tensor parallelism) sets it; the hooks and
  // any call wrapper still run around it. One per module; an error if it has one.
  using ForwardOverride = std::function<at::Tensor(Module& module, const Inputs& inputs)>;
  void set_forward_override(ForwardOverride forward);
  bool has_forward_override() const { return static_cast<bool>(forward_override_); }
  // Replaces the override a plan set, by one that computes it together with other modules'
  // (hp::ShareInputGather); an error if it has none.
  void replace_forward_override(ForwardOverride forward);

  // This module's own parameter `name` (not a dotted path).
  const at::Tensor& param(const std::string& name) const;
  // Replaces this module's own parameter `name`, e.g. by a DTensor of the same global shape.
  void set_param(const std::string& name, at::Tensor value);
  const Init& param_init(const std::string& name) const;
  void set_param_init(const std::string& name, Init init);

  // This module and every hp::nn submodule, depth first, with FQNs ("" for this module).
  std::vector<std::pair<std::string, Module*>> named_modules_fqn();

 protected:
  // Override one: forward(x) for one-input modules, forward_inputs for others.
  virtual at::Tensor forward(const at::Tensor& x);
  virtual at::Tensor forward_inputs(const Inputs& inputs);

  // Registers a parameter of `shape` without storage; init_parameters gives it values.
  void add_param(const std::string& name, std::vector<int64_t> shape, Init init, bool requires_grad = true);

  template <typename M>
  std::shared_ptr<M> add_module(const std::string& name, std::shared_ptr<M> module) {
    return register_module(name, std::move(module));
  }

 private:
  void check_initialized() const;
  at::Tensor call_unwrapped(Inputs inputs);

  std::vector<std::pair<int64_t, PreHook>> pre_hooks_;
  std::vector<std::pair<int64_t, PostHook>> post_hooks_;
  std::vector<std::pair<std::string, Init>> inits_;
  CallWrapper call_wrapper_;
  ForwardOverride forward_override_;
  int64_t next_hook_id_ = 0;
};

// The hp::nn module at `fqn` ("" = root); an error names the missing segment.
Module& find_module(Module& root, const std::string& fqn);
// Whether `fqn` matches `pattern`: same number of segments, '*' matching any one segment.
bool fqn_matches(const std::string& pattern, const std::string& fqn);
// Every module whose FQN matches `pattern` ('*' matches one whole segment), in model order.
std::vector<std::pair<std::string, Module*>> match_modules(Module& root, const std::string& pattern);
// Splits "a.b.weight" into the owning module and the parameter name, and replaces it.
void replace_parameter(Module& root, const std::string& fqn, at::Tensor value);

}  // namespace hp::nn
