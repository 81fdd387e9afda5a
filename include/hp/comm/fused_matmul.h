// Communication fused with a matmul, for tensor parallelism with sequence parallelism ("async TP";
// PyTorch's symm_mem fused_all_gather_matmul and fused_matmul_reduce_scatter):
//
//   // x_shard [batch, seq/n, dim] on each of the n members; w_local [dim, ffn/n]
//   hp::comm::AllGatherMatmul r = hp::comm::all_gather_matmul(tp, x_shard, {w_local}, /*gather_dim=*/1);
//   // r.outputs[0] == all_gather(x_shard, dim 1) @ w_local; r.gathered == that all_gather
//   at::Tensor y = hp::comm::matmul_reduce_scatter(tp, h, w2_local, /*scatter_dim=*/1);
//   // y == reduce_scatter(h @ w2_local, sum, dim 1)
//
// On a group whose members share this host's memory and use the shared-memory transport, the
// operands meet in symmetric memory the group keeps for these ops (hp/comm/symmetric_memory.h),
// and the work goes chunk by chunk: all_gather_matmul multiplies this member's own rows while the
// others are still putting theirs, then each peer's rows as they arrive, read straight from the
// peer's buffer; matmul_reduce_scatter multiplies the rows each member keeps and writes them into
// that member's buffer, the next member's first and its own last, so that the peers add while it
// still multiplies. No member waits for the slowest before it starts multiplying. The sum adds the
// members' products in rank order with tree_reduce's association (hp/comm/tree_reduce.h), the order
// of the deterministic reduce_scatter. The workspace is each member's largest op's data (a shard
// for all_gather_matmul, the whole product for matmul_reduce_scatter: n pieces) rounded up to a
// power of two, at least 1 MiB, kept while the group lives. Where there is no room for it on
// some member (a full /dev/shm: a container's is often 64 MiB), each member says so once and the
// group runs its fused ops unfused from then on, on every member alike. Elsewhere (groups across hosts, the
// Gloo transport, tensors off the CPU, a fake world) both run as the unfused collective and matmul,
// which a group says once in a warning.
//
// Both are collectives: every member calls them in the same order with the same shapes (a member
// with other shapes fails every member naming it), with the group's timeout and failure reports;
// after a failure on a group, every later fused op on it fails too. Not differentiable: the tensor-
// parallel styles build their backward from these two (hp/parallel/tensor_parallel.h,
// set_async_tp). CommDebugMode counts them as "all_gather_matmul" and "matmul_reduce_scatter"
// (the unfused form counts its all_gather or reduce_scatter). Use from one thread per member.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "hp/comm/process_group.h"

namespace hp::comm {

struct AllGatherMatmul {
  at::Tensor gathered;              // all_gather(a_shard, gather_dim); undefined unless asked for
  std::vector<at::Tensor> outputs;  // gathered @ bs[i]
};

// `a_shard`: [..., K] with the gathered dim not the last; each of `bs`: [K, N_i], a_shard's dtype
// and device (none: only the gather). The results may be non-contiguous views (gather_dim != 0):
// they are computed with the gathered dim first.
AllGatherMatmul all_gather_matmul(const ProcessGroup& group, const at::Tensor& a_shard,
                                  const std::vector<at::Tensor>& bs, int64_t gather_dim, bool return_gathered = true);

// reduce_scatter(a @ b, sum, scatter_dim): this member's piece. `a`: [..., K] with
// a.size(scatter_dim) divisible by the group's size and scatter_dim not the last dim; `b`: [K, N],
// a's dtype and device.
at::Tensor matmul_reduce_scatter(const ProcessGroup& group, const at::Tensor& a, const at::Tensor& b,
                                 int64_t scatter_dim);

// The bytes of `group`'s workspace for these ops, per member (every member's alike; between
// processes the group's members map n of them in /dev/shm), as the ops run on it so far have grown
// it: 0 where it runs them unfused. On a fake world (a dry run), which maps nothing, what a group of
// members sharing a host would map for the same ops.
int64_t fused_workspace_bytes(const ProcessGroup& group);

}  // namespace hp::comm
