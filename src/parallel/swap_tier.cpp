#include "parallel/swap_tier.h"

#include <fcntl.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "hp/core/error.h"
#include "hp/core/log.h"

namespace hp::detail {

SwapTier::Buffer SwapTier::acquire(const Key& key, int64_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = free_.find(key); it != free_.end()) {
    Buffer buffer = std::move(it->second);
    free_.erase(it);
    in_use_ += size;
    return buffer;
  }
  Buffer buffer = allocate(key, size);
  buffer.key = key;
  buffer.size = size;
  buffer.held = true;
  held_ += size;
  in_use_ += size;
  return buffer;
}

void SwapTier::release(Buffer buffer) {
  if (!buffer.held) return;
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= buffer.size;
  Key key = buffer.key;
  free_.emplace(std::move(key), std::move(buffer));
}

int64_t SwapTier::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

int64_t SwapTier::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

namespace {

class HostTier final : public SwapTier {
 public:
  void write(const Buffer& to, const void* from) override {
    std::memcpy(to.bytes.get(), from, static_cast<size_t>(to.size));
  }
  void read(const Buffer& from, void* to) override {
    std::memcpy(to, from.bytes.get(), static_cast<size_t>(from.size));
  }

 private:
  Buffer allocate(const Key& /*key*/, int64_t size) override {
    Buffer buffer;
    buffer.bytes = std::make_unique<uint8_t[]>(static_cast<size_t>(size));
    return buffer;
  }
};

constexpr int64_t kPage = 4096;
constexpr long kTmpfsMagic = 0x01021994;

// One unnamed file per manager: nothing to clean up, whatever way the process ends. Its pages are
// written through and dropped from the page cache, so that swapped tensors hold neither the
// process's memory nor the kernel's.
class FileTier final : public SwapTier {
 public:
  explicit FileTier(std::string directory) : directory_(std::move(directory)) {
    HP_CHECK(!directory_.empty(), "activation swap: the file tier needs a directory (SwapOptions::directory)");
    std::error_code ignored;  // a directory that cannot be made fails the open below, by name
    std::filesystem::create_directories(directory_, ignored);
    fd_ = ::open(directory_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd_ < 0 && errno != ENOENT && errno != ENOTDIR && errno != EACCES) {
      // A file system without O_TMPFILE: a named file, unlinked at once.
      std::string path = directory_ + "/hp-swap-XXXXXX";
      fd_ = ::mkostemp(path.data(), O_CLOEXEC);
      if (fd_ >= 0) ::unlink(path.c_str());
    }
    HP_CHECK(fd_ >= 0, "activation swap: cannot create the file tier's file in '", directory_,
             "': ", std::strerror(errno));
    struct statfs fs {};
    if (::fstatfs(fd_, &fs) == 0 && static_cast<long>(fs.f_type) == kTmpfsMagic)
      log::warn("activation swap: '", directory_, "' is a tmpfs, which keeps the file tier in memory; ",
                "give the swap a directory on a disk");
  }
  ~FileTier() override { ::close(fd_); }

  void write(const Buffer& to, const void* from) override {
    const auto* p = static_cast<const uint8_t*>(from);
    for (int64_t done = 0; done < to.size;) {
      const ssize_t n = ::pwrite(fd_, p + done, static_cast<size_t>(to.size - done), to.offset + done);
      if (n < 0 && errno == EINTR) continue;
      HP_CHECK(n > 0, "activation swap: writing ", to.size, " bytes to the file tier in '", directory_,
               "' failed: ", std::strerror(errno));
      done += n;
    }
    // Written back now and dropped, rather than left dirty in the page cache.
    ::sync_file_range(fd_, to.offset, to.size,
                      SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    ::posix_fadvise(fd_, to.offset, to.size, POSIX_FADV_DONTNEED);
  }

  void read(const Buffer& from, void* to) override {
    auto* p = static_cast<uint8_t*>(to);
    for (int64_t done = 0; done < from.size;) {
      const ssize_t n = ::pread(fd_, p + done, static_cast<size_t>(from.size - done), from.offset + done);
      if (n < 0 && errno == EINTR) continue;
      HP_CHECK(n > 0, "activation swap: reading ", from.size, " bytes back from the file tier in '", directory_,
               "' failed: ", n == 0 ? "the file is shorter than written" : std::strerror(errno));
      done += n;
    }
    ::posix_fadvise(fd_, from.offset, from.size, POSIX_FADV_DONTNEED);
  }

 private:
  // Page-aligned extents, so that dropping one buffer's cached pages never touches another's.
  // The space is reserved here, on the region's thread: a full disk fails the forward that asked.
  Buffer allocate(const Key& /*key*/, int64_t size) override {
    Buffer buffer;
    buffer.offset = end_;
    const int error = ::posix_fallocate(fd_, end_, size);
    HP_CHECK(error == 0, "activation swap: cannot reserve ", size, " bytes for the file tier in '", directory_, "' (",
             std::strerror(error), ")");
    end_ += (size + kPage - 1) / kPage * kPage;
    return buffer;
  }

  std::string directory_;
  int fd_ = -1;
  int64_t end_ = 0;
};

}  // namespace

std::unique_ptr<SwapTier> make_swap_tier(const SwapOptions& options) {
  if (options.tier == SwapOptions::Tier::kFile) return std::make_unique<FileTier>(options.directory);
  return std::make_unique<HostTier>();
}

}  // namespace hp::detail
