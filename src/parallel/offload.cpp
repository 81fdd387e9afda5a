#include "hp/parallel/offload.h"

#include <utility>

#include "hp/core/error.h"
#include "parallel/swap_tier.h"

namespace hp {
namespace {

// A StorageTier over the swap tier's buffers: each allocation is one buffer, reused by size once
// its tensor is gone.
class BufferTier final : public StorageTier {
 public:
  explicit BufferTier(std::unique_ptr<detail::SwapTier> buffers) : buffers_(std::move(buffers)) {}

  struct InBuffer final : Allocation {
    std::shared_ptr<BufferTier> tier;
    detail::SwapTier::Buffer buffer;
    // In a DataPtr's deleter: nothing may escape. A buffer the pool cannot take back is freed.
    ~InBuffer() override {
      try {
        if (tier) tier->buffers_->release(buffer);
      } catch (...) {
      }
    }
  };

  std::unique_ptr<Allocation> allocate(int64_t bytes) override {
    auto held = std::make_unique<InBuffer>();
    held->buffer = buffers_->acquire(bytes);
    held->tier =
        std::static_pointer_cast<BufferTier>(shared_from_this());  // after acquire: a failed one gives nothing back
    held->data = buffers_->address(held->buffer);
    held->bytes = bytes;
    return held;
  }
  void prefetch(Allocation& a) override { buffers_->prefetch(static_cast<InBuffer&>(a).buffer); }
  void settle(Allocation& a) override { buffers_->settle(static_cast<InBuffer&>(a).buffer); }

  OffloadStats stats() const { return {buffers_->in_use(), buffers_->held()}; }

 private:
  std::unique_ptr<detail::SwapTier> buffers_;
};

}  // namespace

ParameterOffload::ParameterOffload(OffloadOptions options) : options_(std::move(options)) {
  SwapOptions buffers;
  buffers.tier = options_.tier == OffloadOptions::Tier::kFile ? SwapOptions::Tier::kFile : SwapOptions::Tier::kHost;
  buffers.directory = options_.directory;
  tier_ = std::make_shared<BufferTier>(detail::make_swap_tier(buffers, "parameter offload"));  // makes the directory
  // The file tier's tensors are mapped: their writes reach the disk with no call to fail.
  HP_CHECK(options_.tier != OffloadOptions::Tier::kFile || !detail::on_copy_on_write_file_system(options_.directory),
           "parameter offload: '", options_.directory,
           "' is on a copy-on-write file system (btrfs, ZFS, bcachefs), where a full disk fails a write into the "
           "mapped file with no way to report it; give the file tier a directory on ext4 or xfs");
}

ParameterOffload::~ParameterOffload() = default;

OffloadStats ParameterOffload::stats() const { return static_cast<const BufferTier&>(*tier_).stats(); }

StorageTier& ParameterOffload::tier() { return *tier_; }

}  // namespace hp
