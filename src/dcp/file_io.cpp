#include "dcp/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "hp/core/error.h"

namespace hp::dcp::detail {

FileWriter::FileWriter(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  HP_CHECK(fd_ >= 0, "dcp: cannot create ", path_, ": ", std::strerror(errno));
}

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::write(const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    HP_CHECK(n > 0, "dcp: writing ", path_, " failed: ", std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
    position_ += static_cast<uint64_t>(n);
  }
}

void FileWriter::sync_and_close() {
  HP_CHECK(::fsync(fd_) == 0, "dcp: fsync of ", path_, " failed: ", std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  HP_CHECK(::close(fd) == 0, "dcp: closing ", path_, " failed: ", std::strerror(errno));
}

FileReader::FileReader(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  HP_CHECK(fd_ >= 0, "dcp: cannot open ", path_, ": ", std::strerror(errno));
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);
}

void FileReader::read_at(void* out, size_t bytes, uint64_t offset) const {
  auto* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    HP_CHECK(n >= 0, "dcp: reading ", path_, " failed: ", std::strerror(errno));
    HP_CHECK(n > 0, "dcp: ", path_, " ends at byte ", offset, " but ", bytes, " more bytes were expected (truncated)");
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  FileWriter out(tmp);
  out.write(bytes.data(), bytes.size());
  out.sync_and_close();
  std::filesystem::rename(tmp, path);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  HP_CHECK(in, "dcp: cannot open ", path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace hp::dcp::detail
