// Where swapped tensors wait for their backward: buffers reused by size in bytes, either in host
// memory outside the compute allocator or in an unnamed file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "hp/parallel/activation_swap.h"

namespace hp::detail {

class SwapTier {
 public:
  struct Buffer {
    int64_t size = 0;
    bool from_tier = false;            // false: no buffer
    std::unique_ptr<uint8_t[]> bytes;  // host tier
    int64_t offset = 0;                // file tier
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

 protected:
  // A new buffer of `size` bytes (the pool's lock is held).
  virtual Buffer allocate(int64_t size) = 0;

 private:
  mutable std::mutex mu_;
  std::multimap<int64_t, Buffer> free_;  // by size
  int64_t in_use_ = 0, held_ = 0;
};

// The tier `options` name: host memory, or a file in options.directory.
std::unique_ptr<SwapTier> make_swap_tier(const SwapOptions& options);

// Whether the file system at `path` keeps its files in memory (tmpfs, ramfs): a file tier there
// saves nothing.
bool on_memory_file_system(const std::string& path);

}  // namespace hp::detail
