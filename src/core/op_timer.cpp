#include "hp/core/op_timer.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <chrono>
#include <unordered_map>

#ifdef HP_WITH_CUDA
#include <torch/cuda.h>
#endif

namespace hp {
namespace {

#ifdef HP_WITH_CUDA
// The GPU of the first CUDA tensor the op returned, or -1.
int cuda_device_returned(const OpStack& stack) {
  for (const c10::IValue& value : stack) {
    if (value.isTensor() && value.toTensor().is_cuda()) return value.toTensor().device().index();
    if (value.isTensorList())
      for (const at::Tensor& t : value.toTensorList().vec())
        if (t.defined() && t.is_cuda()) return t.device().index();
  }
  return -1;
}
#endif

}  // namespace

void OpTimer::dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) {
  const auto start = std::chrono::steady_clock::now();
  run_below(op, keys, stack);
#ifdef HP_WITH_CUDA
  if (const int gpu = cuda_device_returned(*stack); gpu >= 0) torch::cuda::synchronize(gpu);  // device time
#endif
  Time& t = ops_[op_name(op)];
  t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ++t.calls;
}

void OpTimer::kernel_ran(const char* name, int64_t /*bytes*/, double seconds) {
  Time& t = ops_[std::string("hp::") + name];
  t.seconds += seconds;
  ++t.calls;
}

std::map<std::string, OpTimer::Time> OpTimer::by_class() const {
  std::map<std::string, Time> classes;
  for (const auto& [name, t] : ops_) {
    Time& c = classes[op_class(name)];
    c.seconds += t.seconds;
    c.calls += t.calls;
  }
  return classes;
}

double OpTimer::total_seconds() const {
  double total = 0.0;
  for (const auto& [name, t] : ops_) total += t.seconds;
  return total;
}

std::string op_class(const std::string& op_name) {
  if (op_name.rfind("hp::", 0) == 0) return "hp kernel";
  // By the op's base name: "aten::add_.Tensor" -> "add"; in-place and out= forms share a class.
  std::string base = op_name.substr(0, op_name.find('.'));
  if (base.rfind("aten::", 0) == 0) base = base.substr(6);
  while (!base.empty() && base.back() == '_') base.pop_back();
  static const std::unordered_map<std::string, std::string> classes = [] {
    std::unordered_map<std::string, std::string> m;
    const auto put = [&m](const char* cls, std::initializer_list<const char*> names) {
      for (const char* n : names) m[n] = cls;
    };
    put("matmul", {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "mv", "addmv", "dot", "linear",
                   "_mkldnn_matmul", "mkldnn_linear"});
    put("reduction", {"sum", "mean", "amax", "amin", "max", "min", "logsumexp", "norm", "linalg_vector_norm", "prod",
                      "var", "std", "argmax", "argmin", "any", "all", "cumsum", "_foreach_norm"});
    put("copy and cast", {"copy", "_to_copy", "clone", "cat", "stack", "_copy_from", "_copy_from_and_resize"});
    put("indexing", {"embedding", "embedding_dense_backward", "index_select", "index_add", "index_copy", "index_put",
                     "index", "gather", "scatter", "scatter_add", "take", "masked_fill", "masked_select", "where",
                     "nll_loss_forward", "nll_loss_backward", "sort", "topk"});
    put("allocation and fill", {"empty", "empty_strided", "empty_like", "zeros", "zeros_like", "ones", "full",
                                "full_like", "zero", "fill", "arange", "resize"});
    put("view", {"view",    "reshape",      "_reshape_alias",   "as_strided", "transpose", "t",
                 "permute", "expand",       "unsqueeze",        "squeeze",    "select",    "slice",
                 "narrow",  "split",        "split_with_sizes", "chunk",      "unbind",    "alias",
                 "detach",  "_unsafe_view", "contiguous",       "view_as",    "flatten",   "unflatten"});
    put("elementwise", {"add",
                        "sub",
                        "mul",
                        "div",
                        "neg",
                        "exp",
                        "log",
                        "pow",
                        "sqrt",
                        "rsqrt",
                        "silu",
                        "silu_backward",
                        "sigmoid",
                        "sigmoid_backward",
                        "tanh",
                        "abs",
                        "sign",
                        "maximum",
                        "minimum",
                        "clamp",
                        "clamp_min",
                        "clamp_max",
                        "lerp",
                        "addcmul",
                        "addcdiv",
                        "_softmax",
                        "_log_softmax",
                        "_softmax_backward_data",
                        "_log_softmax_backward_data",
                        "reciprocal",
                        "eq",
                        "ne",
                        "gt",
                        "ge",
                        "lt",
                        "le",
                        "isinf",
                        "isnan",
                        "isfinite",
                        "logical_and",
                        "logical_or",
                        "logical_not",
                        "bitwise_and",
                        "bitwise_or",
                        "cos",
                        "sin",
                        "_foreach_mul",
                        "_foreach_add",
                        "_foreach_addcmul",
                        "_foreach_addcdiv",
                        "_foreach_sqrt",
                        "_foreach_div",
                        "_foreach_lerp",
                        "_foreach_sub",
                        "nan_to_num",
                        "masked_scale",
                        "threshold_backward",
                        "relu",
                        "gelu",
                        "gelu_backward"});
    return m;
  }();
  const auto it = classes.find(base);
  return it == classes.end() ? "other" : it->second;
}

}  // namespace hp
