// Tensor storage in a memory tier other than the compute allocator: where FSDP's parameter offload
// (hp/parallel/offload.h) keeps sharded parameters, their gradients and their optimizer state.
//
// A tensor in a tier is an ordinary CPU tensor whose storage a StorageTier allocated: every op reads
// and writes it as usual, and the compute allocator (what hp::MemoryTracker counts) does not hold
// it. What a tier does between uses is its own: a host tier keeps the bytes in host memory; a file
// tier maps them from a file and, when told a use is over (settle_storage), writes them back and
// drops them from memory, reading them in again at the next use (ahead of it: prefetch_storage).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace hp {

class StorageTier : public std::enable_shared_from_this<StorageTier> {
 public:
  // Bytes of one storage. Destroying it gives them back to the tier.
  struct Allocation {
    virtual ~Allocation() = default;
    void* data = nullptr;
    int64_t bytes = 0;
  };

  virtual ~StorageTier() = default;
  // `bytes` of storage, contents unspecified. A tier is owned by shared pointers: every tensor in
  // it holds one.
  virtual std::unique_ptr<Allocation> allocate(int64_t bytes) = 0;
  // Starts bringing an allocation's bytes into memory for a use that follows soon.
  virtual void prefetch(Allocation&) {}
  // A use of the allocation is over until the next one: a file tier writes its bytes back and
  // drops them from memory. Throws hp::Error when the write-back failed; a file tier then drops
  // nothing more and fails every later settle and allocation.
  virtual void settle(Allocation&) {}
};

// The tier `t`'s storage lives in; null for the compute allocator's (or no storage).
StorageTier* storage_tier_of(const at::Tensor& t);

// Moves `t`'s storage into `tier` in place and settles it: the same tensor (and every view of its
// storage) with the same values, its old bytes given back to their allocator. Nothing to do when the storage is
// in `tier` already or holds no bytes. CPU tensors; a meta tensor (a dry run) moves without bytes,
// so that what would be in the tier is not counted as the compute allocator's.
void move_storage_to(const at::Tensor& t, StorageTier& tier);

// A contiguous tensor of `sizes` and `options` (CPU or meta) in `tier`, contents unspecified; one
// of no elements is an ordinary empty tensor.
at::Tensor empty_in_tier(StorageTier& tier, at::IntArrayRef sizes, const at::TensorOptions& options);

// Zeros shaped like `t`, in the tier `t` lives in (optimizer state follows its parameter) and
// settled there, else at::zeros_like(t).
at::Tensor zeros_like_in_its_tier(const at::Tensor& t);

// prefetch / settle (above) for each tensor that lives in a tier; the others are left alone.
void prefetch_storage(const std::vector<at::Tensor>& tensors);
void settle_storage(const std::vector<at::Tensor>& tensors);

// Runs `use` on each of `tensors` in order, for work that touches each once (a gradient norm, a
// scaling): each one in a tier is read ahead while the one before it is in use, and settled once
// its use is done, so that a file tier holds about two of them in memory at a time.
void use_in_turn(const std::vector<at::Tensor>& tensors, const std::function<void(const at::Tensor&)>& use);

}  // namespace hp
