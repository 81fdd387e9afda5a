// Parameter offload (FSDP2's CPUOffloadPolicy; ZeRO-Offload / ZeRO-Infinity's tiers): the sharded
// parameters of chosen fully_shard units, their gradients and their optimizer state live in a
// second memory tier instead of the compute allocator, and are brought in for each use.
//
//   hp::OffloadOptions file{hp::OffloadOptions::Tier::kFile, "/nvme"};
//   hp::FullyShardOptions options;
//   options.offload = std::make_shared<hp::ParameterOffload>(file);
//   for (auto& [fqn, block] : hp::nn::match_modules(model, "layers.*"))
//     hp::fully_shard(*block, mesh, options);
//   hp::AdamW optimizer(model.parameters());  // its state follows the parameters into the tier
//
// What moves, and when:
//  - a unit's shards move into the tier at fully_shard (shards without storage yet, from deferred
//    initialization, get it there); each gather copies them into the compute allocator as always;
//  - each reduced gradient is made in the tier; hp's optimizers (AdamW, Muon) make each state
//    tensor in the tier of its parameter, and step on them there;
//  - host tier: the bytes stay in host memory outside the compute allocator (on an accelerator,
//    off the device; on a CPU, out of what the compute allocator holds, though the process holds them);
//  - file tier: the bytes are extents of one unnamed file in `directory` (not on a copy-on-write
//    file system), mapped into the process. After each use in a step (a unit's gather, a
//    gradient's reduction or zeroing, the optimizer's update) they are written back and dropped
//    from the process's memory and the page cache; ahead of the next they are read in (a unit's
//    gather reads its shards in one request and starts on those of the units it prefetches;
//    hp::AdamW streams chunk by chunk, reading the next while it updates one; hp::Muon brings its
//    group in at once). A checkpoint save or load, a replica check or initialization leaves what it
//    touched in memory until its next use in a step settles it.
// Tensors in the tier are ordinary CPU tensors: checkpoints, gradient clipping and replica checks
// read and write them as usual. The numbers are bitwise those without offload. ZeRO-3 units only
// (ShardingLevel::kParameters); hp::AdamW with its foreach step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "hp/core/storage_tier.h"

namespace hp {

struct OffloadOptions {
  enum class Tier { kHost, kFile };
  Tier tier = Tier::kHost;
  std::string directory;  // the file tier's, on a disk (a tmpfs is memory); made if missing
};

struct OffloadStats {
  int64_t bytes_in_use = 0;  // tensors in the tier now
  int64_t bytes_held = 0;    // the tier's buffers, in use or kept for reuse by size
};

class ParameterOffload {
 public:
  explicit ParameterOffload(OffloadOptions options = {});
  ~ParameterOffload();
  ParameterOffload(const ParameterOffload&) = delete;
  ParameterOffload& operator=(const ParameterOffload&) = delete;

  const OffloadOptions& options() const { return options_; }
  OffloadStats stats() const;
  // Where the tensors live (hp/core/storage_tier.h).
  StorageTier& tier();

 private:
  OffloadOptions options_;
  std::shared_ptr<StorageTier> tier_;
};

}  // namespace hp
