// Value types shared by the collectives: reduce ops, per-collective options, group options.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace hp::comm {

enum class ReduceOp { kSum, kAvg, kMax, kMin };

std::string to_string(ReduceOp op);

// How the collectives of a group move data (docs/collectives.md#transports). Point-to-point
// messages (send, recv, batch_isend_irecv) always go through Gloo.
enum class Transport {
  kAuto,  // shared memory where the members of a group can share it, else Gloo (docs/collectives.md)
  kGloo,  // c10d's Gloo over TCP, always
  kShm,   // shared memory for each group whose members share this host; Gloo for groups across hosts
};

std::string to_string(Transport transport);

// The format in which a sum or avg reduction (all_reduce, reduce_scatter) carries floating-point
// data between ranks (docs/collectives.md#low-precision-reductions). Other than kNative, every
// rank's input is rounded to the format, moved in it, and the members add what they receive in
// fp32, in the tree order (hp/comm/tree_reduce.h), before one cast to the tensor's dtype.
enum class WireFormat {
  kNative,   // the tensor's own dtype, added in it (bf16 sums in bf16)
  kBf16,     // bf16 on the wire (half of fp32's bytes), added in fp32
  kFp8E4M3,  // fp8 e4m3 with one fp32 scale per block of 128 values (a little over a quarter of fp32's
             // bytes), added in fp32; emulated on the CPU
};

std::string to_string(WireFormat format);

// Options of a process group (and of every group derived from it, e.g. by a DeviceMesh).
struct ProcessGroupOptions {
  // A collective that has not completed after this long fails with hp::TimeoutError naming the
  // collective, the group and the ranks that never arrived.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Sum/avg reductions of floating-point data use one fixed association order (a balanced binary
  // tree over group ranks, see tree_reduce.h), so results are bitwise reproducible and equal to the
  // same tree computed on one rank. Costs one extra copy of the data; see docs/collectives.md.
  bool deterministic = false;
  // Host the Gloo transport binds to; empty = loopback for single-node jobs, else the hostname.
  std::string gloo_hostname;
  // The environment variable HP_COMM_TRANSPORT (auto, gloo or shm) replaces kAuto.
  Transport transport = Transport::kAuto;

  ProcessGroupOptions& set_timeout(std::chrono::milliseconds t) {
    timeout = t;
    return *this;
  }
  ProcessGroupOptions& set_deterministic(bool d) {
    deterministic = d;
    return *this;
  }
  ProcessGroupOptions& set_gloo_hostname(std::string h) {
    gloo_hostname = std::move(h);
    return *this;
  }
  ProcessGroupOptions& set_transport(Transport t) {
    transport = t;
    return *this;
  }
};

struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  WireFormat wire = WireFormat::kNative;  // other formats: fp32, bf16 or fp16 tensors, sum or avg
};

// Gathers every rank's input along `dim`. `sizes[r]` is rank r's size along `dim`; empty means
// every rank contributes input.size(dim) (the even case).
struct AllGatherOptions {
  int64_t dim = 0;
  std::vector<int64_t> sizes;
};

// Reduces across ranks, then rank r keeps piece r of the result along `dim`. `sizes[r]` is piece
// r's size; empty means torch.chunk(input, group_size, dim) pieces (the last may be smaller or empty).
struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  int64_t dim = 0;
  std::vector<int64_t> sizes;
  WireFormat wire = WireFormat::kNative;  // other formats: fp32, bf16 or fp16 tensors, sum or avg
};

// Splits the input along dim 0: piece r (input_split_sizes[r] rows) goes to rank r; the output
// holds the pieces received from ranks 0..n-1 in order (output_split_sizes[r] rows from rank r).
// Both empty = even split of dim 0 by the group size.
struct AllToAllOptions {
  std::vector<int64_t> output_split_sizes;
  std::vector<int64_t> input_split_sizes;
};

}  // namespace hp::comm
