// The few POSIX file operations checkpoints need, with errors that name the file: whole writes,
// positioned reads, fsync, and the write-then-rename that makes a file appear complete or not at all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hp::dcp::detail {

class FileWriter {
 public:
  explicit FileWriter(std::string path);  // creates or truncates
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;
  void write(const void* data, size_t bytes);
  void sync_and_close();
  uint64_t position() const { return position_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t position_ = 0;
};

class FileReader {
 public:
  explicit FileReader(std::string path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;
  // Reads exactly `bytes` at `offset`; a short read (truncated file) is an error naming the file.
  void read_at(void* out, size_t bytes, uint64_t offset) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Writes `bytes` to `path` through `path.tmp`, fsync and rename: readers see the old or the new file.
void write_file_atomically(const std::string& path, const std::string& bytes);
std::string read_file(const std::string& path);
// Makes a rename inside `dir` durable (best effort where directories cannot be opened).
void fsync_directory(const std::string& dir);

}  // namespace hp::dcp::detail
