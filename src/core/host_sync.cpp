#include "hp/core/host_sync.h"

#include <ATen/ATen.h>

namespace hp {
namespace {
thread_local HostSyncCount* innermost = nullptr;
}  // namespace

HostSyncCount::HostSyncCount() : outer_(innermost) { innermost = this; }

HostSyncCount::~HostSyncCount() { innermost = outer_; }

at::Tensor to_host(const at::Tensor& t) {
  for (HostSyncCount* count = innermost; count != nullptr; count = count->outer_) ++count->count_;
  return t.device().is_cpu() ? t : t.to(at::kCPU);
}

std::vector<int64_t> to_host_int64s(const at::Tensor& t) {
  const at::Tensor host = to_host(t).contiguous();
  TORCH_CHECK(host.dim() == 1 && host.scalar_type() == at::kLong, "to_host_int64s: expects a 1-D int64 tensor, got ",
              host.sizes(), " ", host.scalar_type());
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
}

}  // namespace hp
