// Counting the ATen ops a thread runs, and the arithmetic of its matrix products: a DispatchMode
// for tests (how many matmuls a backward runs) and for FLOP accounting.
//
//   hp::OpCounter counter;
//   {
//     hp::DispatchModeGuard on(counter);
//     loss.backward();
//   }
//   counter.count("aten::mm");   // matrix products backward ran
//   counter.matmul_flops();      // 2 * m * n * k summed over them
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "hp/core/dispatch_mode.h"

namespace hp {

// The FLOPs of a call of matrix product `op_name` (mm, addmm, bmm, baddbmm and their out= forms),
// whose arguments start at `args`: 2 * m * n * k per product of [m, k] by [k, n], per batch entry.
// -1 for other ops.
int64_t matmul_flops_of(const std::string& op_name, const c10::IValue* args);

class OpCounter : public DispatchMode {
 public:
  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override;

  // Calls of `op` ("aten::mm", "aten::add.Tensor") seen so far.
  int64_t count(const std::string& op) const;
  // Calls of the matrix products: mm, addmm, bmm, baddbmm (and their out= forms).
  int64_t matmuls() const { return matmuls_; }
  // Their floating-point operations: 2 * m * n * k per product of [m, k] by [k, n], per batch entry.
  int64_t matmul_flops() const { return matmul_flops_; }
  const std::map<std::string, int64_t>& counts() const { return counts_; }

 private:
  std::map<std::string, int64_t> counts_;
  int64_t matmuls_ = 0, matmul_flops_ = 0;
};

}  // namespace hp
