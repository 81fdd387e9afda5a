// Reading device data on the host: the point where the host waits for the device. On the CPU a
// read costs nothing, but code meant to run well on accelerators reads through hp::to_host, so that
// tests can hold it to a budget (a MoE layer's forward reads once):
//
//   hp::HostSyncCount syncs;       // counts this thread's reads while it lives
//   at::Tensor y = moe(x);
//   EXPECT_EQ(syncs.count(), 1);
//
// Only reads made through to_host are counted: code under such a budget reads device data no
// other way (no .item(), no data_ptr of a tensor that may live on a device).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace hp {

// `t` on the CPU (itself when it is there already), counted as one read.
at::Tensor to_host(const at::Tensor& t);
// The values of a 1-D int64 tensor, read on the host: one read.
std::vector<int64_t> to_host_int64s(const at::Tensor& t);

class HostSyncCount {
 public:
  HostSyncCount();
  ~HostSyncCount();
  HostSyncCount(const HostSyncCount&) = delete;
  HostSyncCount& operator=(const HostSyncCount&) = delete;
  // Reads by this thread since construction (nested counts each count them).
  int64_t count() const { return count_; }

 private:
  friend at::Tensor to_host(const at::Tensor& t);
  int64_t count_ = 0;
  HostSyncCount* outer_;
};

}  // namespace hp
