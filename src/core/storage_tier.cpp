#include "hp/core/storage_tier.h"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

#include <cstring>
#include <utility>

#include "hp/core/error.h"

namespace hp {
namespace {

// A tier's storage as a DataPtr's context: the deleter below is how a storage is known to be in
// a tier. A meta tensor (a dry run) is in a tier without bytes: it only says where the real one
// would live, so that the dry run's compute-allocator count leaves it out.
struct InTier {
  std::shared_ptr<StorageTier> tier;                    // declared first: it outlives the allocation
  std::unique_ptr<StorageTier::Allocation> allocation;  // null on the meta device
};

std::shared_ptr<StorageTier> owner_of(StorageTier& tier) {
  std::shared_ptr<StorageTier> owner = tier.weak_from_this().lock();
  HP_CHECK(owner != nullptr, "storage tier: a tier must be owned by a std::shared_ptr (its tensors share it)");
  return owner;
}

void give_back(void* context) { delete static_cast<InTier*>(context); }

at::DataPtr allocate_in(StorageTier& tier, int64_t bytes, const at::Device& device) {
  std::shared_ptr<StorageTier> owner = owner_of(tier);
  if (device.is_meta()) return at::DataPtr(nullptr, new InTier{std::move(owner), nullptr}, &give_back, device);
  HP_CHECK(device.is_cpu(), "storage tier: tensors in a tier are CPU tensors, not ", device);
  auto held = std::make_unique<InTier>(InTier{std::move(owner), tier.allocate(bytes)});
  HP_CHECK(held->allocation && held->allocation->bytes >= bytes, "storage tier: an allocation of ", bytes,
           " bytes came back smaller");
  void* data = held->allocation->data;
  return at::DataPtr(data, held.release(), &give_back, device);
}

InTier* in_tier(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const at::DataPtr& data = t.storage().data_ptr();
  return data.get_deleter() == &give_back ? static_cast<InTier*>(data.get_context()) : nullptr;
}

}  // namespace

StorageTier* storage_tier_of(const at::Tensor& t) {
  const InTier* held = in_tier(t);
  return held ? held->tier.get() : nullptr;
}

void move_storage_to(const at::Tensor& t, StorageTier& tier) {
  if (!t.has_storage() || storage_tier_of(t) == &tier) return;
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<int64_t>(storage->nbytes());
  if (bytes == 0 || (!t.is_meta() && storage->data_ptr().get() == nullptr)) return;  // nothing to move
  at::DataPtr moved = allocate_in(tier, bytes, t.device());
  if (!t.is_meta()) std::memcpy(moved.get(), storage->data_ptr().get(), static_cast<size_t>(bytes));
  storage->set_data_ptr_noswap(std::move(moved));  // the old bytes go back to their allocator here
  settle_storage({t});
}

at::Tensor empty_in_tier(StorageTier& tier, at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t bytes = c10::multiply_integers(sizes) *
                        static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  if (bytes == 0) return at::empty(sizes, options);  // nothing to hold
  // A meta tensor's set_ "resizes" its storage to the size it has (no allocation): the storage
  // must allow it, which takes an allocator.
  const bool meta = options.device().is_meta();
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, allocate_in(tier, bytes, options.device()),
                       /*allocator=*/meta ? c10::GetAllocator(at::kMeta) : nullptr, /*resizable=*/meta);
  return at::empty({0}, options).set_(storage, 0, sizes, c10::contiguous_strides(sizes));
}

at::Tensor zeros_like_in_its_tier(const at::Tensor& t) {
  StorageTier* tier = storage_tier_of(t);
  if (!tier) return at::zeros_like(t, at::MemoryFormat::Preserve);
  at::Tensor zeros = empty_in_tier(*tier, t.sizes(), t.options()).zero_();
  settle_storage({zeros});
  return zeros;
}

void prefetch_storage(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors)
    if (InTier* held = in_tier(t); held && held->allocation) held->tier->prefetch(*held->allocation);
}

void settle_storage(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& t : tensors)
    if (InTier* held = in_tier(t); held && held->allocation) held->tier->settle(*held->allocation);
}

void use_in_turn(const std::vector<at::Tensor>& tensors, const std::function<void(const at::Tensor&)>& use) {
  if (!tensors.empty()) prefetch_storage({tensors.front()});
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i + 1 < tensors.size()) prefetch_storage({tensors[i + 1]});
    use(tensors[i]);
    settle_storage({tensors[i]});
  }
}

}  // namespace hp
