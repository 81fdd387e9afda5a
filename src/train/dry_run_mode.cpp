#include "train/dry_run_mode.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <functional>
#include <unordered_map>
#include <vector>

#include "hp/core/libtorch_version.h"

namespace hp::train::detail {
namespace {

using MetaKernel = std::function<void(OpStack&)>;

at::Tensor pop_tensor(OpStack& stack) {
  at::Tensor t = stack.back().toTensor();
  stack.pop_back();
  return t;
}

// The shapes of ops LibTorch 1.13 runs only on devices with values (their CPU kernels, or a
// composite one over such ops); LibTorch 2.x has meta kernels for them. Each allocates the output
// its CPU kernel returns, not that kernel's scratch.
const std::unordered_map<std::string, MetaKernel>& missing_meta_kernels() {
  static const auto* kernels = new std::unordered_map<std::string, MetaKernel> {
#if !HP_LIBTORCH_2
    // embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse): rows of the weight.
    {"aten::embedding",
     [](OpStack& s) {
       torch::jit::drop(s, 3);
       const at::Tensor indices = pop_tensor(s), weight = pop_tensor(s);
       std::vector<int64_t> shape(indices.sizes().begin(), indices.sizes().end());
       shape.push_back(weight.size(1));
       s.emplace_back(at::empty(shape, weight.options()));
     }},
        // embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq).
        {"aten::embedding_dense_backward",
         [](OpStack& s) {
           torch::jit::drop(s, 2);
           const int64_t rows = s.back().toInt();
           s.pop_back();
           pop_tensor(s);
           const at::Tensor grad = pop_tensor(s);
           s.emplace_back(at::empty({rows, grad.size(-1)}, grad.options().device(at::kMeta)));
         }},
        // index_select(self, dim, index): self with `dim` as long as the index.
        {"aten::index_select",
         [](OpStack& s) {
           const at::Tensor index = pop_tensor(s);
           const int64_t dim = s.back().toInt();
           s.pop_back();
           const at::Tensor self = pop_tensor(s);
           std::vector<int64_t> shape(self.sizes().begin(), self.sizes().end());
           if (!shape.empty()) shape[at::maybe_wrap_dim(dim, self.dim())] = index.numel();
           s.emplace_back(at::empty(shape, self.options().device(at::kMeta)));
         }},
        {"aten::logical_or",
         [](OpStack& s) {
           const at::Tensor other = pop_tensor(s), self = pop_tensor(s);
           s.emplace_back(at::empty(at::infer_size(self.sizes(), other.sizes()),
                                    self.options().dtype(at::kBool).device(at::kMeta)));
         }},
        {"aten::isinf",
         [](OpStack& s) {
           const at::Tensor self = pop_tensor(s);
           s.emplace_back(at::empty(self.sizes(), self.options().dtype(at::kBool).device(at::kMeta)));
         }},
        // logsumexp(self, dim[], keepdim): the reduced shape; integers give the default float dtype.
        {"aten::logsumexp", [](OpStack& s) {
           const bool keepdim = s.back().toBool();
           s.pop_back();
           const std::vector<int64_t> dims = s.back().toIntVector();
           s.pop_back();
           const at::Tensor self = pop_tensor(s);
           std::vector<bool> reduced(self.dim(), dims.empty());
           for (int64_t d : dims) reduced[at::maybe_wrap_dim(d, self.dim())] = true;
           std::vector<int64_t> shape;
           for (int64_t d = 0; d < self.dim(); ++d) {
             if (!reduced[d])
               shape.push_back(self.size(d));
             else if (keepdim)
               shape.push_back(1);
           }
           const at::ScalarType dtype = at::isFloatingType(self.scalar_type())
                                            ? self.scalar_type()
                                            : at::typeMetaToScalarType(at::get_default_dtype());
           s.emplace_back(at::empty(shape, self.options().dtype(dtype).device(at::kMeta)));
         }},
#endif
  };
  return *kernels;
}

// The _foreach_ ops (an optimizer's step over lists of tensors), which LibTorch 1.13 has no meta
// kernels for: an in-place one changes no shape; one that returns a list returns a new tensor like
// each tensor of its first argument.
bool foreach_on_meta(const c10::OperatorHandle& op, OpStack& stack) {
#if HP_LIBTORCH_2
  return false;
#else
  const std::string name = op.schema().name();
  if (name.rfind("aten::_foreach_", 0) != 0) return false;
  const size_t arguments = op.schema().arguments().size();
  const std::vector<at::Tensor> first = stack[stack.size() - arguments].toTensorVector();
  torch::jit::drop(stack, arguments);
  if (op.schema().returns().empty()) return true;
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : first) out.push_back(at::empty_like(t));
  stack.emplace_back(out);
  return true;
#endif
}

// Whether `v` holds a tensor with values (not on the meta device), and the largest floating-point one.
bool has_values(const c10::IValue& v, int64_t* largest_floating) {
  const auto check = [&](const at::Tensor& t) {
    if (!t.defined() || t.is_meta()) return false;
    if (t.is_floating_point()) *largest_floating = std::max(*largest_floating, t.numel());
    return true;
  };
  bool found = false;
  if (v.isTensor()) found = check(v.toTensor());
  if (v.isTensorList())
    for (const at::Tensor& t : v.toTensorVector()) found = check(t) || found;
  return found;
}

}  // namespace

void DryRunMode::dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) {
  const size_t arguments = op.schema().arguments().size();
  bool values = false, meta = false;
  int64_t ignored = 0;
  for (size_t i = stack->size() - arguments; i < stack->size(); ++i) {
    const c10::IValue& v = (*stack)[i];
    values = has_values(v, &ignored) || values;
    meta = meta || (v.isTensor() && v.toTensor().defined() && v.toTensor().is_meta()) ||
           (v.isTensorList() && !v.toTensorVector().empty() && v.toTensorVector()[0].is_meta());
  }
  const std::string name = op_name(op);
  if (meta) {
    const auto& kernels = missing_meta_kernels();
    if (auto it = kernels.find(name); it != kernels.end()) return it->second(*stack);
    if (foreach_on_meta(op, *stack)) return;
  }
  run_below(op, keys, stack);
  // Computing on data is producing a floating-point tensor with values: positions, masks, counts
  // and sizes are integers or booleans, and a host table copied to the meta device becomes meta.
  int64_t largest_floating = 0;
  for (size_t i = stack->size() - op.schema().returns().size(); i < stack->size(); ++i)
    values = has_values((*stack)[i], &largest_floating) || values;
  if (!values) return;
  ++host_ops_[name];
  if (largest_floating > kMetadataElements) ++host_compute_[name];
}

}  // namespace hp::train::detail
