#include "train/replica_check.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>

#include "hp/dcp/state_dict.h"
#include "hp/dtensor/dtensor.h"

namespace hp::train::detail {
namespace {

// One shard in the exchange: its value's hash and its name, in a fixed-size row so that the rows of
// all ranks gather in one tensor. A longer name keeps its start and a hash of the whole.
constexpr size_t kNameBytes = 120;
constexpr int64_t kRowBytes = 8 + kNameBytes;

std::string fit(const std::string& name) {
  if (name.size() < kNameBytes) return name;
  std::ostringstream out;
  out << name.substr(0, kNameBytes - 19) << "#" << std::hex << hash_bytes(name.data(), name.size());
  return out.str();
}

// "fqn [dp_shard 1, tp 0]": the parameter and its coordinates on the mesh dims it is not
// replicated on. Ranks with the same name hold replicas of one shard.
std::string shard_name(const std::string& fqn, const at::Tensor& parameter) {
  if (!is_dtensor(parameter)) return fqn;
  const DTensor d(parameter);
  const DeviceMesh& mesh = d.device_mesh();
  std::ostringstream name;
  name << fqn;
  const char* separator = " [";
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    if (d.placements()[i].is_replicate()) continue;
    name << separator << mesh.dim_names()[i] << " " << mesh.get_local_rank(i);
    separator = ", ";
  }
  if (std::strcmp(separator, ", ") == 0) name << "]";
  return name.str();
}

// Named apart from ATen's own at::hash_tensor (LibTorch 2.x), which argument-dependent lookup finds too.
uint64_t shard_hash(const at::Tensor& t) {
  const at::Tensor bytes = t.to(at::kCPU).contiguous();  // a GPU shard is hashed from a host copy
  return hash_bytes(bytes.data_ptr(), bytes.numel() * bytes.element_size());
}

std::string join_ranks(const std::vector<int>& ranks) {
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

}  // namespace

uint64_t hash_bytes(const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ size;
  const auto mix = [&](uint64_t w) {
    h ^= w * 0xFF51AFD7ED558CCDULL;
    h = ((h << 31) | (h >> 33)) * 0x9E3779B97F4A7C15ULL;
  };
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    mix(w);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, p + i, size - i);
  mix(tail);
  return h ^ (h >> 29);
}

ReplicaReport check_replicas(const models::ModelParts& parts, torch::optim::Optimizer* optimizer,
                             const comm::ProcessGroup& world) {
  std::vector<std::pair<std::string, at::Tensor>> named = parts.named_parameters();
  if (optimizer != nullptr) {
    dcp::StateDict state;
    dcp::add_optimizer_state(state, *optimizer, *parts.model);
    named.insert(named.end(), state.tensors.begin(), state.tensors.end());
  }
  at::Tensor mine = at::zeros({static_cast<int64_t>(named.size()), kRowBytes}, at::kByte);
  for (size_t i = 0; i < named.size(); ++i) {
    const at::Tensor& parameter = named[i].second;
    const std::string name = fit(shard_name(named[i].first, parameter));
    const at::Tensor local = is_dtensor(parameter) ? DTensor(parameter).to_local() : parameter;
    const uint64_t value = shard_hash(local.detach());
    uint8_t* row = mine[static_cast<int64_t>(i)].data_ptr<uint8_t>();
    std::memcpy(row, &value, 8);
    std::memcpy(row + 8, name.data(), name.size());
  }
  // Pipeline ranks hold different numbers of parameters: pad every rank's rows to the largest.
  const at::Tensor counts = world.all_gather(at::tensor({static_cast<int64_t>(named.size())}, at::kLong));
  const int64_t rows = counts.max().item<int64_t>();
  at::Tensor padded = at::zeros({rows, kRowBytes}, at::kByte);
  padded.narrow(0, 0, mine.size(0)).copy_(mine);
  const at::Tensor all = world.all_gather(padded).contiguous();
  const uint8_t* rows_of_all = all.data_ptr<uint8_t>();
  const int64_t* count_of = counts.contiguous().data_ptr<int64_t>();

  std::vector<ShardHash> hashes;
  for (int r = 0; r < world.size(); ++r)
    for (int64_t i = 0; i < count_of[r]; ++i) {
      const uint8_t* row = rows_of_all + (r * rows + i) * kRowBytes;
      ShardHash h;
      std::memcpy(&h.value, row, 8);
      h.shard = reinterpret_cast<const char*>(row + 8);
      h.rank = r;
      hashes.push_back(std::move(h));
    }
  return find_mismatches(hashes);
}

ReplicaReport find_mismatches(const std::vector<ShardHash>& hashes) {
  // shard name -> value hash -> world ranks holding it.
  std::map<std::string, std::map<uint64_t, std::vector<int>>> holders;
  for (const ShardHash& h : hashes) holders[h.shard][h.value].push_back(h.rank);
  ReplicaReport report;
  for (const auto& [name, by_value] : holders) {
    if (by_value.size() > 1 || by_value.begin()->second.size() > 1) ++report.replicated_shards;
    if (by_value.size() < 2) continue;
    // The majority is the one value held by more ranks than any other.
    size_t most = 0, with_most = 0;
    for (const auto& [value, ranks] : by_value) {
      if (ranks.size() > most) most = ranks.size(), with_most = 0;
      if (ranks.size() == most) ++with_most;
    }
    ReplicaMismatch m;
    m.parameter = name;
    for (const auto& [value, ranks] : by_value) {
      const bool majority = with_most == 1 && ranks.size() == most;
      auto& into = majority ? m.agree : m.odd;
      into.insert(into.end(), ranks.begin(), ranks.end());
    }
    std::sort(m.odd.begin(), m.odd.end());
    std::sort(m.agree.begin(), m.agree.end());
    report.mismatches.push_back(std::move(m));
  }
  return report;
}

std::string describe(const std::vector<ReplicaMismatch>& mismatches) {
  std::ostringstream out;
  for (const ReplicaMismatch& m : mismatches) {
    out << (out.tellp() > 0 ? "; " : "") << m.parameter << ": ";
    if (m.agree.empty())
      out << "ranks " << join_ranks(m.odd) << " disagree, with no majority to say which is wrong";
    else
      out << (m.odd.size() == 1 ? "rank " : "ranks ") << join_ranks(m.odd) << " differ"
          << (m.odd.size() == 1 ? "s" : "") << " from ranks " << join_ranks(m.agree);
  }
  return out.str();
}

}  // namespace hp::train::detail
