#include "parallel/swap_tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <new>
#include <string>
#include <utility>

#include "hp/core/error.h"
#include "hp/core/log.h"

namespace hp::detail {

SwapTier::Buffer SwapTier::acquire(int64_t size) {
  check_usable();
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = free_.find(size); it != free_.end()) {
    Buffer buffer = std::move(it->second);
    free_.erase(it);
    in_use_ += size;
    return buffer;
  }
  Buffer buffer = allocate(size);
  buffer.size = size;
  buffer.from_tier = true;
  held_ += size;
  in_use_ += size;
  return buffer;
}

void SwapTier::release(Buffer& buffer) {
  if (!buffer.from_tier) return;
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= buffer.size;
  const int64_t size = buffer.size;
  free_.emplace(size, std::exchange(buffer, Buffer{}));
}

int64_t SwapTier::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

int64_t SwapTier::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

void Unmap::operator()(uint8_t* p) const { ::munmap(p, length); }

namespace {

class HostTier final : public SwapTier {
 public:
  void write(const Buffer& to, const void* from) override {
    std::memcpy(to.bytes.get(), from, static_cast<size_t>(to.size));
  }
  void read(const Buffer& from, void* to) override {
    std::memcpy(to, from.bytes.get(), static_cast<size_t>(from.size));
  }
  void* address(Buffer& buffer) override { return buffer.bytes.get(); }

 private:
  // 64-byte aligned, as the compute allocator's, for the vectorised kernels that run on it.
  Buffer allocate(int64_t size) override {
    constexpr size_t kAlignment = 64;
    const size_t rounded = (static_cast<size_t>(std::max<int64_t>(size, 1)) + kAlignment - 1) / kAlignment * kAlignment;
    Buffer buffer;
    buffer.bytes.reset(static_cast<uint8_t*>(std::aligned_alloc(kAlignment, rounded)));
    if (!buffer.bytes) throw std::bad_alloc();
    return buffer;
  }
};

// One unnamed file per manager (O_TMPFILE): nothing to clean up, however the process ends. Its
// pages are written through and dropped from the page cache, so that swapped tensors hold neither
// the process's memory nor the kernel's.
class FileTier final : public SwapTier {
 public:
  FileTier(std::string directory, std::string user)
      : directory_(std::move(directory)), user_(std::move(user)), page_(::sysconf(_SC_PAGESIZE)) {
    HP_CHECK(!directory_.empty(), user_, ": the file tier needs a directory");
    std::error_code made;
    std::filesystem::create_directories(directory_, made);
    fd_ = ::open(directory_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd_ < 0 && errno != ENOENT && errno != ENOTDIR && errno != EACCES) {
      // A file system without O_TMPFILE: a named file, unlinked at once.
      std::string path = directory_ + "/hp-swap-XXXXXX";
      fd_ = ::mkostemp(path.data(), O_CLOEXEC);
      if (fd_ >= 0) ::unlink(path.c_str());
    }
    HP_CHECK(fd_ >= 0, user_, ": cannot create the file tier's file in '", directory_,
             "': ", made ? "making the directory failed: " + made.message() : std::string(std::strerror(errno)));
    if (on_memory_file_system(directory_))
      log::warn(user_, ": '", directory_, "' is a tmpfs or ramfs, which keeps the file tier in memory; ",
                "give it a directory on a disk");
  }
  ~FileTier() override { ::close(fd_); }

  void write(const Buffer& to, const void* from) override {
    const auto* p = static_cast<const uint8_t*>(from);
    for (int64_t done = 0; done < to.size;) {
      const ssize_t n = ::pwrite(fd_, p + done, static_cast<size_t>(to.size - done), to.offset + done);
      if (n < 0 && errno == EINTR) continue;
      HP_CHECK(n > 0, user_, ": writing ", to.size, " bytes to the file tier in '", directory_,
               "' failed: ", n == 0 ? "no byte written" : std::strerror(errno));
      done += n;
    }
    // Written back now and dropped, rather than left dirty in the page cache. A failed write-back
    // is an error here: the pages would be dropped all the same, and the reload would read
    // whatever the disk holds.
    const int synced = ::sync_file_range(
        fd_, to.offset, to.size, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    HP_CHECK(synced == 0, user_, ": writing ", to.size, " bytes back to the disk of the file tier in '", directory_,
             "' failed: ", std::strerror(errno));
    drop_cached(to);
  }

  void read(const Buffer& from, void* to) override {
    auto* p = static_cast<uint8_t*>(to);
    for (int64_t done = 0; done < from.size;) {
      const ssize_t n = ::pread(fd_, p + done, static_cast<size_t>(from.size - done), from.offset + done);
      if (n < 0 && errno == EINTR) continue;
      HP_CHECK(n > 0, user_, ": reading ", from.size, " bytes back from the file tier in '", directory_,
               "' failed: ", n == 0 ? "the file is shorter than written" : std::strerror(errno));
      done += n;
    }
    drop_cached(from);
  }

  // Mapped shared with the file: what the tensor writes reaches the file, and the pages can be
  // dropped and read in again.
  void* address(Buffer& buffer) override {
    if (!buffer.mapped) {
      void* at = ::mmap(nullptr, static_cast<size_t>(extent(buffer.size)), PROT_READ | PROT_WRITE, MAP_SHARED, fd_,
                        buffer.offset);
      HP_CHECK(at != MAP_FAILED, user_, ": cannot map ", buffer.size, " bytes of the file tier in '", directory_,
               "': ", std::strerror(errno));
      buffer.mapped =
          std::unique_ptr<uint8_t, Unmap>(static_cast<uint8_t*>(at), Unmap{static_cast<size_t>(extent(buffer.size))});
      // No read-ahead on faults: it would bring in the file's next extents, other tensors' bytes.
      // Each use reads its own range ahead instead (prefetch).
      ::madvise(at, buffer.mapped.get_deleter().length, MADV_RANDOM);
    }
    return buffer.mapped.get();
  }

  void prefetch(const Buffer& buffer) override {
    if (buffer.mapped) ::madvise(buffer.mapped.get(), buffer.mapped.get_deleter().length, MADV_WILLNEED);
  }

  // Written back first: dropping pages whose write failed would lose what they held (the next use
  // would read whatever the disk has). The kernel reports a failed write-back once per file, to
  // whichever sync comes next, and marks the failed pages clean: so one settle at a time, and after
  // any failure nothing is dropped any more and the tier refuses to go on.
  void settle(const Buffer& buffer) override {
    if (!buffer.mapped) return;
    std::lock_guard<std::mutex> lock(settling_);
    check_usable();
    const size_t length = buffer.mapped.get_deleter().length;
    if (::msync(buffer.mapped.get(), length, MS_SYNC) != 0) {
      failed_ = true;
      HP_FAIL(user_, ": writing back to the disk of the file tier in '", directory_, "' failed: ", std::strerror(errno),
              "; what the tier holds can no longer be trusted (the kernel may drop pages it failed to write), and ",
              "it takes no more work");
    }
    ::madvise(buffer.mapped.get(), length, MADV_DONTNEED);  // out of this process's memory
    drop_cached(buffer);                                    // and out of the page cache
  }

  void check_usable() const override {
    HP_CHECK(!failed_, user_, ": an earlier write-back to the file tier in '", directory_,
             "' failed; what it holds can no longer be trusted, and it takes no more work");
  }

 private:
  int64_t extent(int64_t size) const { return (size + page_ - 1) / page_ * page_; }

  // The whole extent, its last partial page too (extents never share a page).
  void drop_cached(const Buffer& b) { ::posix_fadvise(fd_, b.offset, extent(b.size), POSIX_FADV_DONTNEED); }

  // Page-aligned extents. The space is reserved here, on the thread that runs the model, so that a
  // full disk fails there (on file systems that honour the reservation; copy-on-write ones may
  // still fail the write, on the copy thread).
  Buffer allocate(int64_t size) override {
    Buffer buffer;
    buffer.offset = end_;
    int error = 0;
    do {
      error = ::posix_fallocate(fd_, end_, size);
    } while (error == EINTR);
    HP_CHECK(error == 0, user_, ": cannot reserve ", size, " bytes for the file tier in '", directory_, "' (",
             std::strerror(error), ")");
    end_ += extent(size);
    return buffer;
  }

  std::string directory_, user_;
  int64_t page_;
  std::atomic<bool> failed_{false};
  std::mutex settling_;
  int fd_ = -1;
  int64_t end_ = 0;
};

}  // namespace

namespace {

// The file system's magic number at `path` (statfs's f_type), or 0 when it cannot be told.
uint32_t file_system_magic(const std::string& path) {
  struct statfs fs {};
  return ::statfs(path.c_str(), &fs) == 0 ? static_cast<uint32_t>(fs.f_type) : 0;
}

}  // namespace

bool on_copy_on_write_file_system(const std::string& path) {
  constexpr uint32_t kBtrfsMagic = 0x9123683e, kZfsMagic = 0x2fc12fc1, kBcachefsMagic = 0xca451a4e;
  const uint32_t magic = file_system_magic(path);
  return magic == kBtrfsMagic || magic == kZfsMagic || magic == kBcachefsMagic;
}

bool on_memory_file_system(const std::string& path) {
  constexpr uint32_t kTmpfsMagic = 0x01021994, kRamfsMagic = 0x858458f6;
  const uint32_t magic = file_system_magic(path);
  return magic == kTmpfsMagic || magic == kRamfsMagic;
}

std::unique_ptr<SwapTier> make_swap_tier(const SwapOptions& options, const std::string& user) {
  if (options.tier == SwapOptions::Tier::kFile) return std::make_unique<FileTier>(options.directory, user);
  return std::make_unique<HostTier>();
}

}  // namespace hp::detail
