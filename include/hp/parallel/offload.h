// Parameter offload (FSDP2's CPUOffloadPolicy; ZeRO-Offload / ZeRO-Infinity's tiers): the sharded
// parameters of chosen fully_shard units, their gradients and their optimizer state live in a
// second memory tier instead of the compute allocator, and are brought in for each use.
//
//   auto offload = std::make_shared<hp::ParameterOffload>(hp::OffloadOptions{hp::OffloadOptions::Tier::kFile,
//   "/nvme"}); hp::FullyShardOptions options; options.offload = offload; for (auto& [fqn, block] :
//   hp::nn::match_modules(model, "layers.*")) hp::fully_shard(*block, mesh, options); hp::AdamW
//   optimizer(model.parameters());   // its state follows the parameters into the tier
//
// What moves, and when:
//  - a unit's shards move into the tier at fully_shard (shards without storage yet, from deferred
//    initialization, get it there); each gather copies them into the compute allocator as always;
//  - each reduced gradient is made in the tier; hp's optimizers (AdamW, Muon) make each state
//    tensor in the tier of its parameter, and step on them there;
//  - host tier: the bytes stay in host memory outside the compute allocator (on an accelerator,
//    off the device; on a CPU, out of what the compute allocator holds, though the process holds them);
//  - file tier: the bytes are extents of one unnamed file in `directory`, mapped into the process.
//    After each use (a unit's gather, a gradient's reduction, an optimizer step) they are written
//    back and dropped from the process's memory and the page cache; before the next use they are
//    read ahead (a unit's gather starts reading the units it prefetches; an optimizer step starts
//    reading all it will touch). Resident memory then holds none of them between uses.
// Tensors in the tier are ordinary CPU tensors: checkpoints, gradient clipping and replica checks
// read and write them as usual. The numbers are bitwise those without offload.
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
