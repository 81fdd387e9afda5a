// The only place that knows which c10d API version we build against.
//
// LibTorch 1.13 exposes collectives on c10d::ProcessGroup (ProcessGroupGloo derives from it);
// LibTorch 2.x moved them to c10d::Backend. Everything above this file calls the functions here and
// never names those classes. Capability queries (which dtypes/ops the backend reduces natively)
// also live here, because they are backend- and version-specific facts.
#pragma once

#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "hp/comm/types.h"

namespace gloo::transport {
class Device;
}

namespace hp::comm::shim {

#if TORCH_VERSION_MAJOR >= 2
using NativeGroup = c10d::Backend;
#else
using NativeGroup = c10d::ProcessGroup;
#endif
using NativeGroupPtr = c10::intrusive_ptr<NativeGroup>;
using NativeWork = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;
using DevicePtr = std::shared_ptr<::gloo::transport::Device>;

StorePtr make_tcp_store(const std::string& host, int port, bool is_server, int world_size,
                        std::chrono::milliseconds timeout);
// A store in a file that every rank of one host opens (c10d's FileStore).
StorePtr make_file_store(const std::string& path, int world_size);
StorePtr make_hash_store();
// A client of hprun's rendezvous store for jobs on several nodes (hp/core/store_wire.h), which
// presents `secret`; retries connecting until `timeout`, and throws when the server refuses it.
StorePtr make_rendezvous_client(const std::string& host, int port, const std::string& secret,
                                std::chrono::milliseconds timeout);
// The first line of an error's message, without the backtrace a c10::Error carries.
std::string first_line(const std::exception& e);
// Whether a c10d or Gloo error message says that an operation ran out of time.
bool says_timed_out(const std::string& message);
StorePtr make_prefix_store(const std::string& prefix, StorePtr store);

DevicePtr make_gloo_device(const std::string& hostname);
// Blocks until all `size` members have constructed the group (full-mesh connect).
NativeGroupPtr make_gloo_group(StorePtr store, int rank, int size, std::chrono::milliseconds timeout, DevicePtr device);

// True when the backend reduces `dtype` with `op` itself (Gloo 1.13: no bf16, no avg).
bool can_reduce(const NativeGroup& group, at::ScalarType dtype, ReduceOp op);
bool gloo_reduces(at::ScalarType dtype, ReduceOp op);
// The same bytes as a dtype the backend can move (bf16 -> fp16 bits on Gloo, bool -> uint8).
at::Tensor to_wire(const NativeGroup& group, const at::Tensor& t);

NativeWork all_reduce(NativeGroup& group, at::Tensor tensor, ReduceOp op);
NativeWork all_gather(NativeGroup& group, std::vector<at::Tensor> outputs, at::Tensor input);
NativeWork all_to_all(NativeGroup& group, at::Tensor output, at::Tensor input, std::vector<int64_t> output_splits,
                      std::vector<int64_t> input_splits);
NativeWork broadcast(NativeGroup& group, at::Tensor tensor, int root);
NativeWork send(NativeGroup& group, at::Tensor tensor, int peer, int tag);
NativeWork recv(NativeGroup& group, at::Tensor tensor, int peer, int tag);
NativeWork barrier(NativeGroup& group);

}  // namespace hp::comm::shim
