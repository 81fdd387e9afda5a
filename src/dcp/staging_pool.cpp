#include "dcp/staging_pool.h"

#include <ATen/ATen.h>

#include <mutex>
#include <vector>

namespace hp::dcp::detail {
namespace {

struct Pool {
  std::mutex mutex;
  std::vector<at::Tensor> free;  // byte buffers
  size_t bytes = 0;              // of every buffer the pool made
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: savers may outlive static destruction order
  return *p;
}

size_t nbytes_of(const at::Tensor& like) { return static_cast<size_t>(like.numel()) * like.element_size(); }

}  // namespace

at::Tensor acquire_staging(const at::Tensor& like) {
  const size_t need = nbytes_of(like);
  at::Tensor buffer;
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    // The smallest free buffer that fits, so large buffers stay for large tensors.
    size_t best = p.free.size();
    for (size_t i = 0; i < p.free.size(); ++i)
      if (static_cast<size_t>(p.free[i].numel()) >= need &&
          (best == p.free.size() || p.free[i].numel() < p.free[best].numel()))
        best = i;
    if (best < p.free.size()) {
      buffer = std::move(p.free[best]);
      p.free.erase(p.free.begin() + static_cast<std::ptrdiff_t>(best));
    } else {
      p.bytes += need;
    }
  }
  if (!buffer.defined()) buffer = at::empty({static_cast<int64_t>(need)}, at::kByte);
  // A view of the buffer's first bytes with `like`'s dtype and shape; the view keeps the buffer.
  return buffer.narrow(0, 0, static_cast<int64_t>(need)).view(like.scalar_type()).view(like.sizes());
}

void release_staging(at::Tensor staged) {
  if (!staged.defined()) return;
  // Recover the whole byte buffer behind the view.
  const at::Storage& storage = staged.storage();
  at::Tensor buffer = at::empty({0}, at::kByte).set_(storage, 0, {static_cast<int64_t>(storage.nbytes())}, {1});
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.free.push_back(std::move(buffer));
}

size_t staging_pool_bytes() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  return p.bytes;
}

}  // namespace hp::dcp::detail
