#include "hp/core/op_counter.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace hp {

// The two factors are the first two tensor arguments of mm/bmm (self, mat2) and the two after the
// addend of addmm/baddbmm (self, mat1, mat2).
int64_t matmul_flops_of(const std::string& name, const c10::IValue* args) {
  const std::string base = name.substr(0, name.find('.'));
  size_t first;
  if (base == "aten::mm" || base == "aten::bmm")
    first = 0;
  else if (base == "aten::addmm" || base == "aten::baddbmm")
    first = 1;
  else
    return -1;
  const at::Tensor& a = args[first].toTensor();
  const at::Tensor& b = args[first + 1].toTensor();
  const int64_t batch = a.dim() == 3 ? a.size(0) : 1;
  return 2 * batch * a.size(-2) * a.size(-1) * b.size(-1);
}

void OpCounter::dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) {
  const std::string name = op_name(op);
  ++counts_[name];
  const size_t nargs = op.schema().arguments().size();
  if (const int64_t flops = matmul_flops_of(name, stack->data() + stack->size() - nargs); flops >= 0) {
    ++matmuls_;
    matmul_flops_ += flops;
  }
  run_below(op, keys, stack);
}

int64_t OpCounter::count(const std::string& op) const {
  const auto it = counts_.find(op);
  return it == counts_.end() ? 0 : it->second;
}

}  // namespace hp
