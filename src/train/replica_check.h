// Silent data corruption between replicas (docs/resilience.md#silent-data-corruption): every
// parameter shard that several ranks hold (data-parallel replicas under HSDP, a norm's weight under
// TP), and its optimizer state, must be bitwise the same on each of them after every step, since
// they start equal and take the same update. A flipped bit in one replica's memory breaks that silently; comparing a
// hash of each shard with its replicas' finds it and names the rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/process_group.h"
#include "hp/models/model_parts.h"

namespace torch::optim {
class Optimizer;
}

namespace hp::train::detail {

// A shard whose replicas differ.
struct ReplicaMismatch {
  std::string parameter;   // FQN, and the shard's coordinates on its sharded mesh dims
  std::vector<int> odd;    // world ranks whose value differs from the majority's
  std::vector<int> agree;  // world ranks holding the majority's value (empty: no majority)
};

// One rank's hash of one shard.
struct ShardHash {
  std::string shard;  // the name replicas share (ReplicaMismatch::parameter)
  uint64_t value = 0;
  int rank = 0;
};

struct ReplicaReport {
  std::vector<ReplicaMismatch> mismatches;  // in shard-name order; empty when every replica agrees
  int64_t replicated_shards = 0;            // shards held by two ranks or more: what was compared
};

// The shards whose replicas' hashes differ.
ReplicaReport find_mismatches(const std::vector<ShardHash>& hashes);

// Collective over `world`: hashes this rank's parameter shards and, with an `optimizer`, their
// optimizer state (named as checkpoints name it, "optim.FQN.exp_avg"), exchanges the hashes, and
// returns the same report on every rank. It assumes that replicas compute bitwise alike (the same
// kernels and thread counts on every rank), which holds on one node and across identical nodes.
ReplicaReport check_replicas(const models::ModelParts& parts, torch::optim::Optimizer* optimizer,
                             const comm::ProcessGroup& world);

// "layers.0.attn_norm.weight [dp_shard 0]: rank 2 differs from ranks 0, 1, 3", joined by "; ".
std::string describe(const std::vector<ReplicaMismatch>& mismatches);

// The bytes' 64-bit hash (not cryptographic: it finds corruption, not an adversary).
uint64_t hash_bytes(const void* data, size_t size);

}  // namespace hp::train::detail
