// The dispatch mode a dry run (hp::train::dry_run) runs its step under: it gives meta tensors the
// results of the few ops this LibTorch has no meta kernel for, and counts the ops that compute on
// tensors with values, which a dry run keeps to metadata (a collective's sizes, a loss's slot).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "hp/core/dispatch_mode.h"

namespace hp::train::detail {

class DryRunMode : public DispatchMode {
 public:
  // An op that returns a floating-point tensor with values of more elements than this computed on
  // data (a loss or a norm is one number; positions, masks and counts are integers or booleans).
  static constexpr int64_t kMetadataElements = 64;

  void dispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, OpStack* stack) override;

  // Ops that ran on tensors with values, by name; those that computed on data (kMetadataElements).
  const std::map<std::string, int64_t>& host_ops() const { return host_ops_; }
  const std::map<std::string, int64_t>& host_compute() const { return host_compute_; }

 private:
  std::map<std::string, int64_t> host_ops_, host_compute_;
};

}  // namespace hp::train::detail
