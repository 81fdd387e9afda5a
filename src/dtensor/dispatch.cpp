// The one DTensor kernel (DESIGN 2.1): every ATen op on a DTensor lands here.
//
//   1. collect the DTensor inputs' specs (plain 0-dim tensors count as replicated scalars)
//   2. decide: output shapes from a run on meta tensors, then the op's sharding rule; decisions
//      are cached by (op, input specs, other arguments)
//   3. redistribute inputs whose placements the rule changes
//   4. run the op on the local pieces with autograd excluded (autograd already ran, globally)
//   5. wrap each tensor result as a DTensor; in-place and out= results return the original DTensor
#include <ATen/ATen.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include <mutex>
#include <sstream>
#include <unordered_map>

#include "dtensor/dtensor_impl.h"
#include "hp/core/dispatch_mode.h"
#include "hp/core/error.h"
#include "hp/dtensor/redistribute.h"
#include "hp/dtensor/sharding_rule.h"

namespace hp::detail {
namespace {

struct Decision {
  std::vector<Placements> inputs;
  std::vector<Placements> outputs;
  std::vector<std::vector<int64_t>> output_shapes;
  int local_shape_arg = -1;
  int local_stride_arg = -1;
  bool strides_view_input = false;
  OpSharding::LocalKernel local_kernel;
};

// One DTensor (or replicated scalar) input: where it sits in the argument list.
struct Input {
  size_t arg;
  int list_index;  // -1 for a plain Tensor argument
  at::Tensor local;
  DTensorSpec spec;
};

std::string describe_inputs(const std::vector<Input>& inputs) {
  std::string out;
  for (size_t k = 0; k < inputs.size(); ++k) {
    out += (k ? ", " : "") + to_string(inputs[k].spec.placements()) + " shape [";
    const auto& shape = inputs[k].spec.shape();
    for (size_t d = 0; d < shape.size(); ++d) out += (d ? ", " : "") + std::to_string(shape[d]);
    out += "]";
  }
  return out;
}

// A plain tensor among DTensor arguments is taken as replicated when that cannot be wrong: a 0-dim
// scalar, or an all-zero tensor (autograd fills missing gradients with plain zeros, e.g. in
// split's backward). Anything else is a mistake that would silently mix a piece with a whole.
Input plain_input(const std::string& op, const at::Tensor& t, const DeviceMesh& mesh, size_t arg, int list_index) {
  HP_CHECK(t.dim() == 0 || !at::any(t).item<bool>(), "DTensor: ", op, " mixes a DTensor with a plain tensor of shape ",
           t.sizes(), "; make it a DTensor first (hp::distribute_tensor or DTensor::from_local)");
  return {arg, list_index, t, DTensorSpec(mesh, Placements(mesh.ndim(), Replicate()), t.sizes().vec())};
}

std::vector<Input> collect_inputs(const std::string& op, const std::vector<c10::IValue>& args) {
  const DeviceMesh* mesh = nullptr;
  for (const auto& iv : args) {
    if (iv.isTensor() && dtensor_impl(iv.toTensor())) mesh = &dtensor_impl(iv.toTensor())->spec().mesh();
    if (iv.isTensorList())
      for (const at::Tensor& t : iv.toTensorList().vec())
        if (dtensor_impl(t)) mesh = &dtensor_impl(t)->spec().mesh();
    if (mesh) break;
  }
  HP_CHECK(mesh, "DTensor: ", op, " reached the DTensor kernel without a DTensor argument");
  std::vector<Input> inputs;
  auto add = [&](const at::Tensor& t, size_t arg, int list_index) {
    if (!t.defined()) return;
    if (DTensorImpl* impl = dtensor_impl(t)) {
      HP_CHECK(impl->spec().mesh() == *mesh, "DTensor: ", op,
               " got operands on different meshes: ", impl->spec().mesh().str(), " and ", mesh->str(),
               "; redistribute them onto one mesh first");
      inputs.push_back({arg, list_index, impl->local(), impl->spec()});
    } else {
      inputs.push_back(plain_input(op, t, *mesh, arg, list_index));
    }
  };
  for (size_t a = 0; a < args.size(); ++a) {
    if (args[a].isTensor()) add(args[a].toTensor(), a, -1);
    if (args[a].isTensorList()) {
      const auto list = args[a].toTensorList().vec();
      for (size_t j = 0; j < list.size(); ++j) add(list[j], a, static_cast<int>(j));
    }
  }
  return inputs;
}

// The arguments with every tensor replaced by `replace(input)`.
std::vector<c10::IValue> substitute(const std::vector<c10::IValue>& args, const std::vector<Input>& inputs,
                                    const std::function<at::Tensor(size_t)>& replace) {
  std::vector<c10::IValue> out = args;
  std::unordered_map<size_t, std::vector<at::Tensor>> lists;
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].list_index < 0)
      out[inputs[k].arg] = replace(k);
    else
      lists[inputs[k].arg].push_back(replace(k));
  }
  for (auto& [arg, tensors] : lists) out[arg] = c10::List<at::Tensor>(tensors);
  return out;
}

// Output shapes from running the op on meta tensors of the global shapes; nullopt (with the
// reason in `failure`) when the op has no meta kernel.
std::optional<std::vector<std::vector<int64_t>>> output_shapes_on_meta(const c10::OperatorHandle& op,
                                                                       const std::vector<c10::IValue>& args,
                                                                       const std::vector<Input>& inputs,
                                                                       std::string& failure) {
  torch::jit::Stack stack = substitute(args, inputs, [&](size_t k) {
    if (inputs[k].local.dim() == 0) return inputs[k].local;  // scalars may stay on the CPU
    return at::empty(inputs[k].spec.shape(), inputs[k].local.options().device(at::kMeta));
  });
  try {
    c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset);
    DispatchModeSuspend unseen;  // shape inference, not computation
    op.callBoxed(&stack);
  } catch (const c10::Error& e) {
    failure = std::string(e.what_without_backtrace()).substr(0, 160);
    return std::nullopt;
  }
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& iv : stack) {
    if (iv.isTensor())
      shapes.emplace_back(iv.toTensor().defined() ? iv.toTensor().sizes().vec() : std::vector<int64_t>{});
    if (iv.isTensorList())
      for (const at::Tensor& t : iv.toTensorList().vec()) shapes.emplace_back(t.sizes().vec());
  }
  return shapes;
}

bool returns_tensors(const c10::FunctionSchema& schema) {
  for (const c10::Argument& r : schema.returns())
    if (r.type()->isSubtypeOf(*c10::TensorType::get()) || r.type()->isSubtypeOf(*c10::ListType::ofTensors()))
      return true;
  return false;
}

std::shared_ptr<const Decision> decide(const c10::OperatorHandle& op, const std::string& name,
                                       const std::vector<c10::IValue>& args, const std::vector<Input>& inputs) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<const Decision>> cache;
  std::ostringstream key;
  key << name;
  for (const Input& in : inputs) key << '|' << in.spec.str();
  for (const auto& iv : args)
    if (!iv.isTensor() && !iv.isTensorList()) key << '|' << iv;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache.find(key.str()); it != cache.end()) return it->second;
  }
  const ShardingRule* rule = find_sharding_rule(name);
  if (rule == nullptr)
    throw Error("DTensor: no sharding rule for " + name + " with inputs " + describe_inputs(inputs) +
                "; register one with hp::register_sharding_rule(\"" + name + "\", rule)");
  OpCall call;
  call.op = name;
  for (const auto& iv : args) call.args.push_back(iv.isTensor() || iv.isTensorList() ? c10::IValue() : iv);
  for (const Input& in : inputs) {
    call.dtensor_arg.push_back(static_cast<int>(in.arg));
    call.inputs.push_back(in.spec);
  }
  std::string meta_failure;
  const bool has_outputs = returns_tensors(op.schema());
  if (has_outputs) {
    if (auto shapes = output_shapes_on_meta(op, args, inputs, meta_failure)) call.output_shapes = *shapes;
  }
  OpSharding sharding = (*rule)(call);
  if (call.output_shapes.empty()) call.output_shapes = sharding.output_shapes;
  HP_CHECK(!has_outputs || !call.output_shapes.empty(), "DTensor: cannot infer the output shapes of ", name,
           ": it has no meta kernel (", meta_failure, ") and its sharding rule gives none");
  HP_CHECK(sharding.inputs.size() == inputs.size(), "DTensor: the rule for ", name, " gave placements for ",
           sharding.inputs.size(), " inputs, the call has ", inputs.size());
  HP_CHECK(sharding.outputs.size() == call.output_shapes.size(), "DTensor: the rule for ", name, " gave ",
           sharding.outputs.size(), " output placements, the op has ", call.output_shapes.size(), " tensor outputs");
  auto decision = std::make_shared<Decision>(Decision{sharding.inputs, sharding.outputs, call.output_shapes,
                                                      sharding.local_shape_arg, sharding.local_stride_arg,
                                                      sharding.strides_view_input, sharding.local_kernel});
  std::lock_guard<std::mutex> lock(mu);
  cache.emplace(key.str(), decision);
  return decision;
}

// The argument a mutable return aliases (in-place self, out=), or -1.
int aliased_argument(const c10::FunctionSchema& schema, size_t ret) {
  const auto* alias = schema.returns()[ret].alias_info();
  if (alias == nullptr || !alias->isWrite()) return -1;
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    const auto* arg_alias = schema.arguments()[a].alias_info();
    if (arg_alias != nullptr && arg_alias->isWrite() && *arg_alias == *alias) return static_cast<int>(a);
  }
  return -1;
}

void dtensor_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const std::string name = op_name(op);
  const size_t nargs = schema.arguments().size();
  const std::vector<c10::IValue> args(stack->end() - nargs, stack->end());
  std::vector<Input> inputs = collect_inputs(name, args);
  const auto decision = decide(op, name, args, inputs);

  // Redistribute where the rule asks; an argument the op writes to must not move.
  std::vector<at::Tensor> locals;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Input& in = inputs[k];
    if (in.spec.placements() == decision->inputs[k]) {
      locals.push_back(in.local);
      continue;
    }
    const auto* alias = schema.arguments()[in.arg].alias_info();
    HP_CHECK(alias == nullptr || !alias->isWrite(), "DTensor: ", name, " writes to an argument placed ",
             to_string(in.spec.placements()), " that its rule would move to ", to_string(decision->inputs[k]),
             "; redistribute it before the op");
    locals.push_back(redistribute_local(in.local, in.spec, decision->inputs[k]));
  }
  std::vector<c10::IValue> local_args = substitute(args, inputs, [&](size_t k) { return locals[k]; });
  if (decision->local_shape_arg >= 0) {  // the op spells its output shape: give it this rank's piece's
    const std::vector<int64_t> shape =
        DTensorSpec(inputs.front().spec.mesh(), decision->outputs[0], decision->output_shapes[0]).local_shape();
    local_args[decision->local_shape_arg] = shape;
    if (decision->local_stride_arg >= 0) {
      std::optional<std::vector<int64_t>> strides;
      if (decision->strides_view_input) {  // a view: its strides follow the input's (which may be expanded)
        if (auto s = at::detail::computeStride(locals[0].sizes(), locals[0].strides(), at::IntArrayRef(shape)))
          strides = *s;
        if (!strides) local_args[0] = locals[0].contiguous();  // not viewable as that shape: view a copy
      }
      if (!strides) {
        const auto contiguous = c10::contiguous_strides(shape);
        strides = std::vector<int64_t>(contiguous.begin(), contiguous.end());
      }
      local_args[decision->local_stride_arg] = *strides;
    }
  }
  const DeviceMesh& mesh = inputs.front().spec.mesh();
  torch::jit::drop(*stack, nargs);
  if (decision->local_kernel) {
    std::vector<DTensorSpec> placed;
    for (size_t k = 0; k < inputs.size(); ++k) placed.push_back(inputs[k].spec.with_placements(decision->inputs[k]));
    stack->push_back(decision->local_kernel(
        local_args, DTensorSpec(mesh, decision->outputs[0], decision->output_shapes[0]), placed));
  } else {
    for (auto& iv : local_args) stack->push_back(std::move(iv));
    c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset);
    op.callBoxed(stack);
  }

  const size_t nret = schema.returns().size();
  size_t output = 0;
  for (size_t r = 0; r < nret; ++r) {
    c10::IValue& iv = (*stack)[stack->size() - nret + r];
    const int aliased = aliased_argument(schema, r);
    if (aliased >= 0 && iv.isTensor()) {
      DTensorImpl* self = dtensor_impl(args[aliased].toTensor());
      HP_CHECK(self != nullptr, "DTensor: ", name,
               " writes in place into a plain tensor with DTensor operands; the "
               "result cannot become a DTensor (LibTorch 1.13's max/min(dim) backward does this: use amax/amin "
               "for differentiable maxima)");
      self->set_local(iv.toTensor(), DTensorSpec(mesh, decision->outputs[output], decision->output_shapes[output]));
      iv = args[aliased];
      ++output;
    } else if (iv.isTensor()) {
      if (iv.toTensor().defined())  // optional outputs (e.g. a layer norm gradient not asked for) stay undefined
        iv = make_dtensor(iv.toTensor(), DTensorSpec(mesh, decision->outputs[output], decision->output_shapes[output]));
      ++output;
    } else if (iv.isTensorList()) {
      std::vector<at::Tensor> wrapped;
      for (const at::Tensor& t : iv.toTensorList().vec()) {
        wrapped.push_back(
            make_dtensor(t, DTensorSpec(mesh, decision->outputs[output], decision->output_shapes[output])));
        ++output;
      }
      iv = c10::List<at::Tensor>(wrapped);
    }
  }
}

}  // namespace

void ensure_dtensor_kernel_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Registered as an impl of every ATen op that has no CompositeImplicitAutograd kernel (those
    // decompose above us into ops we do see). A backend fallback would lose to
    // CompositeExplicitAutograd kernels, which is why this is not a fallback (see the spike).
    // A few ops have both a decomposition and a fused CPU kernel (silu_backward): plain CPU
    // tensors run the fused kernel, so we take the op too and run that same kernel on the local
    // pieces; the decomposition rounds differently and would cost bitwise equality.
    static auto* library =
        new torch::Library(torch::Library::IMPL, "aten", kDTensorKey, __FILE__, __LINE__);  // lives for the process
    for (const std::string& name : backend_aten_ops()) {
      try {
        library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&dtensor_kernel>());
      } catch (const c10::Error&) {
        // already has a kernel for our key: nothing to add
      }
    }
  });
}

}  // namespace hp::detail
