// c10d calls for LibTorch 1.13 and 2.x (see c10d_shim.h).
#include "comm/c10d_shim.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace hp::comm::shim {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kAvg:
      return c10d::ReduceOp::AVG;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

bool is_gloo(const NativeGroup& group) { return group.getBackendName() == "gloo"; }

}  // namespace

StorePtr make_tcp_store(const std::string& host, int port, bool is_server, int world_size,
                        std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = is_server;
  opts.numWorkers = world_size;
  opts.waitWorkers = true;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

StorePtr make_file_store(const std::string& path, int world_size) {
  return c10::make_intrusive<c10d::FileStore>(path, world_size);
}

std::string first_line(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  const std::string what = c10 ? c10->what_without_backtrace() : e.what();
  return what.substr(0, what.find('\n'));
}

bool says_timed_out(const std::string& message) {
  for (const char* needle : {"Timed out", "timed out", "Timeout", "timeout"})
    if (message.find(needle) != std::string::npos) return true;
  return false;
}

StorePtr make_hash_store() { return c10::make_intrusive<c10d::HashStore>(); }

StorePtr make_prefix_store(const std::string& prefix, StorePtr store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

DevicePtr make_gloo_device(const std::string& hostname) {
  return c10d::ProcessGroupGloo::createDeviceForHostname(hostname);
}

NativeGroupPtr make_gloo_group(StorePtr store, int rank, int size, std::chrono::milliseconds timeout,
                               DevicePtr device) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(std::move(device));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(std::move(store), rank, size, opts);
}

bool can_reduce(const NativeGroup& group, at::ScalarType dtype, ReduceOp op) {
  return !is_gloo(group) || gloo_reduces(dtype, op);
}

bool gloo_reduces(at::ScalarType dtype, ReduceOp op) {
  if (op == ReduceOp::kAvg) return false;  // "Cannot use ReduceOp.AVG with Gloo"
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;  // notably bf16 and bool: "Invalid scalar type"
  }
}

at::Tensor to_wire(const NativeGroup& group, const at::Tensor& t) {
  if (!is_gloo(group)) return t;
  // Gloo 1.13 moves neither bf16 nor int16; fp16 has the same width and is only copied, never computed on.
  if (t.scalar_type() == at::kBFloat16) return t.view(at::kHalf);
  if (t.scalar_type() == at::kBool) return t.view(at::kByte);
  return t;
}

NativeWork all_reduce(NativeGroup& group, at::Tensor tensor, ReduceOp op) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  return group.allreduce(tensors, opts);
}

NativeWork all_gather(NativeGroup& group, std::vector<at::Tensor> outputs, at::Tensor input) {
  std::vector<std::vector<at::Tensor>> out{std::move(outputs)};
  std::vector<at::Tensor> in{std::move(input)};
  return group.allgather(out, in);
}

NativeWork all_to_all(NativeGroup& group, at::Tensor output, at::Tensor input, std::vector<int64_t> output_splits,
                      std::vector<int64_t> input_splits) {
  return group.alltoall_base(output, input, output_splits, input_splits);
}

NativeWork broadcast(NativeGroup& group, at::Tensor tensor, int root) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return group.broadcast(tensors, opts);
}

NativeWork send(NativeGroup& group, at::Tensor tensor, int peer, int tag) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  return group.send(tensors, peer, tag);
}

NativeWork recv(NativeGroup& group, at::Tensor tensor, int peer, int tag) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  return group.recv(tensors, peer, tag);
}

NativeWork barrier(NativeGroup& group) { return group.barrier(); }

}  // namespace hp::comm::shim
