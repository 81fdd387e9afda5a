// A second memory tier: buffers reused by size in bytes, either in host memory outside the compute
// allocator or in an unnamed file. Activation swap copies tensors in and out of them (write, read);
// parameter offload keeps tensors in them (address, settle, prefetch).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "hp/parallel/activation_swap.h"

namespace hp::detail {

struct FreeBytes {
  void operator()(uint8_t* p) const { std::free(p); }
};
struct Unmap {
  size_t length = 0;
  void operator()(uint8_t* p) const;
};

class SwapTier {
 public:
  struct Buffer {
    int64_t size = 0;
    bool from_tier = false;                     // false: no buffer
    std::unique_ptr<uint8_t, FreeBytes> bytes;  // host tier, 64-byte aligned
    int64_t offset = 0;                         // file tier
    std::unique_ptr<uint8_t, Unmap> mapped;     // file tier, once `address` mapped it
  };

  virtual ~SwapTier() = default;
  // Called on the thread that runs the region, so that running out of space fails there.
  Buffer acquire(int64_t size);
  // Takes `buffer` back for reuse and leaves it empty (none: nothing to do).
  void release(Buffer& buffer);
  int64_t in_use() const;
  int64_t held() const;

  // The copy engine's work; throw hp::Error when the tier fails.
  virtual void write(const Buffer& to, const void* from) = 0;
  virtual void read(const Buffer& from, void* to) = 0;

  // For tensors that live in a buffer: its bytes, addressable (a file tier maps them, shared with
  // the file); then, around each use, prefetch them and settle them afterwards (a file tier reads
  // them ahead, and writes them back and drops them from memory).
  virtual void* address(Buffer& buffer) = 0;
  virtual void prefetch(const Buffer&) {}
  virtual void settle(const Buffer&) {}

 protected:
  // A new buffer of `size` bytes (the pool's lock is held).
  virtual Buffer allocate(int64_t size) = 0;
  // Throws when the tier takes no more work (acquire asks first, whether it reuses or allocates).
  virtual void check_usable() const {}

 private:
  mutable std::mutex mu_;
  std::multimap<int64_t, Buffer> free_;  // by size
  int64_t in_use_ = 0, held_ = 0;
};

// The tier `options` name: host memory, or a file in options.directory. `user` names who uses it,
// in errors ("activation swap", "parameter offload").
std::unique_ptr<SwapTier> make_swap_tier(const SwapOptions& options, const std::string& user = "activation swap");

// Whether the file system at `path` keeps its files in memory (tmpfs, ramfs): a file tier there
// saves nothing.
bool on_memory_file_system(const std::string& path);

// Whether the file system at `path` writes blocks anew on every write (btrfs, ZFS, bcachefs): a
// space reservation does not hold there, so a write into a mapped file can fail with no caller to
// report it to (the process gets SIGBUS).
bool on_copy_on_write_file_system(const std::string& path);

}  // namespace hp::detail
